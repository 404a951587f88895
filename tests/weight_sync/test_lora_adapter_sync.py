"""The disaggregated weight stream of a LoRA actor with `lora_sync: adapters` (issue 24):
over real stage processes, the first sync sends the whole model and every later one only
the adapters, and the rollout (built from another init seed, so its own base differs)
samples what the actor computes. Plus the plan's checks: who holds adapters, and a
rollout that cannot (vllm where the installed vLLM has no LoRA support) is named."""

from __future__ import annotations

import pytest
import torch
from ws_helpers import disaggregated

from hybridflow.config.schema import load_topology
from hybridflow.errors import ConfigError
from hybridflow.pipeline.plan.planner import build_plan
from hybridflow.pipeline.plan.weight_links import adapter_syncs
from hybridflow.pipeline.runtime.runner import run_topology
from hybridflow.stages.rollout import vllm_compat

pytest.importorskip("peft")

LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lora_sync": "adapters"}


@pytest.mark.slow
def test_the_stream_sends_the_model_once_then_adapters_and_the_rollout_follows(tmp_path):
    d = disaggregated(tmp_path, steps=3, **LORA)
    res = run_topology(
        load_topology(d),
        collect=("response_ids", "rollout_logprobs", "old_logprobs"),
        run_id="wsrun-lora-adapters",
    )
    m = [res.metrics[s] for s in range(3)]
    # Step 0's sync is the whole wrapped model, steps 1 and 2 send the adapters only.
    assert [x["reshard/adapters_only"] for x in m] == [0.0, 1.0, 1.0]
    full, adapters = m[0]["weight_sync/bytes"], m[1]["weight_sync/bytes"]
    assert adapters == m[2]["weight_sync/bytes"] and adapters * 5 < full
    assert m[1]["weight_sync/buckets"] < m[0]["weight_sync/buckets"]
    print(f"\nstream bytes per sync: full {full:.0f}, adapters {adapters:.0f}")
    for s in (1, 2):  # after a full, then an adapter-only sync: the actor's own log-probs
        got = {k: v[0] for k, v in res.collected[s].items()}
        torch.testing.assert_close(got["rollout_logprobs"], got["old_logprobs"], atol=1e-4, rtol=0)
    step0 = {k: v[0] for k, v in res.collected[0].items()}  # the rollout's own other base
    assert (step0["rollout_logprobs"] - step0["old_logprobs"]).abs().max() > 0.1


def test_adapter_syncs_name_the_rollouts_that_hold_adapters(tmp_path):
    topo = load_topology(disaggregated(tmp_path, **LORA))
    (sync,) = adapter_syncs(topo)
    assert sync.source == "actor" and sync.targets == ("rollout",)
    assert sync.lora == {
        "lora_rank": 4,
        "lora_alpha": 8.0,
        "lora_target_modules": "all-linear",
    }
    merged = {**LORA, "lora_sync": "merged"}
    assert adapter_syncs(load_topology(disaggregated(tmp_path, **merged))) == ()


def _vllm_rollout(tmp_path) -> dict:
    d = disaggregated(tmp_path, **LORA)
    d["stages"]["gen"]["roles"]["rollout"] = {
        "backend": "vllm",
        "options": {"model": "tiny-vllm", "temperature": 0.0},
    }
    return d


def test_a_vllm_rollout_without_lora_support_is_named_at_plan_time(tmp_path, monkeypatch):
    why = "the installed vLLM has no LoRA support (no vllm/lora package)"
    monkeypatch.setattr(vllm_compat, "lora_unavailable", lambda: why)
    with pytest.raises(ConfigError) as err:
        build_plan(load_topology(_vllm_rollout(tmp_path)), check_data=False)
    assert err.value.path == "stages.trainer.roles.actor.options.lora_sync"
    assert "backend vllm" in str(err.value) and why in str(err.value)
    assert "lora_sync: merged" in str(err.value)


def test_where_vllm_has_lora_a_vllm_rollout_holds_the_adapters(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_compat, "lora_unavailable", lambda: None)
    topo = load_topology(_vllm_rollout(tmp_path))
    build_plan(topo, check_data=False)
    (sync,) = adapter_syncs(topo)
    assert sync.targets == ("rollout",) and sync.lora["lora_rank"] == 4


def test_without_vllm_installed_the_plan_says_so(tmp_path):
    if vllm_compat.vllm_available():
        pytest.skip("vLLM is installed here")
    with pytest.raises(ConfigError, match="vLLM is not installed"):
        build_plan(load_topology(_vllm_rollout(tmp_path)), check_data=False)

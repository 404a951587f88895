"""The vllm rollout holding a LoRA actor's adapters through vLLM's LoRA support (issue 24
item 3): fed as the actor's colocated reshard feeds it (`lora_sync: adapters`: the whole
model once, then only the adapters), it decodes greedily what a plain vllm rollout given
the merged weights decodes, and an adapter-only sync moves its output with the actor's."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from _policy import PRESET, RUN_SEED, left_pad, responses
from vllm_helpers import make_ctx

from hybridflow.errors import BatchError
from hybridflow.models.lora import SHAPE_KEYS, is_adapter
from hybridflow.stages.actor import Actor
from hybridflow.stages.base import StageContext, StageWorld
from hybridflow.stages.rollout import vllm_compat

pytestmark = pytest.mark.skipif(
    not vllm_compat.vllm_available(), reason="vLLM not installed (use .venv-vllm)"
)

LORA = {"lora_rank": 4, "lora_alpha": 8.0}
PROMPTS = [[5, 6, 7, 8], [30, 31, 32, 33, 34, 35], [12, 13]]
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory):
    """A vllm rollout told to hold the adapters (as pipeline/host/setup.py tells it) and
    the LoRA actor colocated with it."""
    from hybridflow.stages.rollout.vllm import VLLMRollout

    run = tmp_path_factory.mktemp("lora")
    role = VLLMRollout()
    role.setup(make_ctx(run))
    actor = Actor()
    actor.setup(
        StageContext(
            stage="engine",
            replica=0,
            device=torch.device("cpu"),
            seed=RUN_SEED,
            run_dir=run,
            options={"model": PRESET, **LORA, "lora_sync": "adapters"},
            colocated={"rollout": role},
            world=StageWorld(role="actor"),
            log=logging.getLogger("test.vllm"),
        )
    )
    role.hold_adapters({k: getattr(actor.opts, k) for k in SHAPE_KEYS}, RUN_SEED)
    yield actor, role
    role.close()


def _greedy(role) -> tuple[list[list[int]], torch.Tensor]:
    ids, mask = left_pad(PROMPTS)
    out, _ = role.handle("generate", {"prompt_ids": ids, "prompt_mask": mask}, GREEDY)
    return responses(out), out["rollout_logprobs"]


def _train(actor: Actor, seed: int) -> None:
    """A stand-in for a training step: only the adapters move (the base is frozen)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in actor.model.named_parameters():
            if is_adapter(name):
                p.add_(torch.randn(p.shape, generator=g) * 0.4)


def _merged(actor: Actor, plain) -> tuple[list[list[int]], torch.Tensor]:
    """What a plain vllm rollout decodes from the actor's merged weights."""
    plain.update_weights(actor.named_weights("merged"), version=actor.version)
    return _greedy(plain)


def test_adapters_decode_as_merged_weights_and_follow_an_adapter_sync(lora_engine, rollout):
    actor, role = lora_engine
    assert role.llm.llm_engine.vllm_config.lora_config.max_lora_rank == 8  # rank 4 -> 8
    before, _ = _greedy(role)  # no adapter yet: the rollout's own base
    assert role.weights.request is None

    _train(actor, 1)
    full = actor.handle("reshard", {}, {"version": 1})[1]
    assert full["reshard/adapters_only"] == 0.0
    first, first_lp = _greedy(role)
    want, want_lp = _merged(actor, rollout)
    assert first == want and first != before
    torch.testing.assert_close(first_lp, want_lp, atol=2e-4, rtol=0)

    _train(actor, 2)
    step = actor.handle("reshard", {}, {"version": 2})[1]
    assert step["reshard/adapters_only"] == 1.0
    adapter_bytes = sum(
        p.numel() * p.element_size() for n, p in actor.model.named_parameters() if is_adapter(n)
    )
    assert step["reshard/bytes"] == adapter_bytes < full["reshard/bytes"] / 10
    second, second_lp = _greedy(role)
    want, want_lp = _merged(actor, rollout)
    assert second == want and second != first
    torch.testing.assert_close(second_lp, want_lp, atol=2e-4, rtol=0)
    # One adapter directory at a time: the first one went when the second replaced it.
    assert [p.name for p in Path(role.weights.dir).iterdir()] == ["adapter-2"]


def test_a_merged_update_drops_the_adapter_until_a_full_one(lora_engine, rollout):
    actor, role = lora_engine
    _train(actor, 3)
    role.update_weights(actor.named_weights("merged"), version=3)  # a checkpoint's policy
    assert role.weights.request is None
    assert _greedy(role)[0] == _merged(actor, rollout)[0]
    with pytest.raises(BatchError, match="does not hold the actor's base"):
        role.update_weights(actor.named_weights("adapters"), version=4)
    with pytest.raises(BatchError, match="failed or was incomplete"):
        _greedy(role)
    buckets = list(actor._buckets("full", 64 << 10))  # as the weight stream sends it
    assert len(buckets) > 2
    for i, bucket in enumerate(buckets):
        role.load_bucket(bucket, last=i == len(buckets) - 1, version=4)
        if i == 0:
            with pytest.raises(BatchError, match="in progress"):
                _greedy(role)
    assert _greedy(role)[0] == _merged(actor, rollout)[0]
    adapters = dict(actor.named_weights("adapters"))
    adapters.pop(next(iter(adapters)))
    with pytest.raises(BatchError, match="1 missing"):
        role.update_weights(adapters.items(), version=5)


def test_a_grpo_run_streams_adapters_to_a_vllm_stage(tmp_path):
    """Through the stage host (it calls hold_adapters after setup): the rollout in its own
    stage gets the whole model once, then adapters only, and samples what the actor
    computes (its recomputed old_logprobs match the rollout's)."""
    from test_rollout_vllm_actor import _grpo

    from hybridflow.config.schema import load_topology
    from hybridflow.pipeline.runtime.runner import run_topology

    d = _grpo(tmp_path, "vllm", True)
    d["run"]["steps"] = 3
    d["stages"]["engine"]["roles"]["actor"]["options"].update(**LORA, lora_sync="adapters")
    seq = ["prompt_ids", "prompt_mask", "response_ids", "response_mask"]
    recompute = {"role": "actor", "op": "get_logprob", "inputs": seq, "outputs": ["old_logprobs"]}
    d["dataflow"].insert(1, recompute)  # after rollout.generate
    res = run_topology(
        load_topology(d), collect=("rollout_logprobs", "old_logprobs"), run_id="vllm-lora"
    )
    m = res.metrics
    assert [x["reshard/adapters_only"] for x in m] == [0.0, 1.0, 1.0]
    assert m[1]["weight_sync/bytes"] * 5 < m[0]["weight_sync/bytes"]
    for s in (1, 2):
        got = {k: v[0] for k, v in res.collected[s].items()}
        torch.testing.assert_close(got["rollout_logprobs"], got["old_logprobs"], atol=2e-4, rtol=0)

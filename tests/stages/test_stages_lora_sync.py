"""Rollouts holding a LoRA actor's adapters unmerged (issue 24 item 3): the hf and native
engines decode base + adapters without merging, and with `lora_sync: adapters` a sync
after the first moves only the adapter tensors. Driven in one process, as the stage host
sets the roles up (the actor's colocated reshard is the same code as the stream's)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from stage_helpers import make_role, prompt_batch

from hybridflow.errors import BatchError, ConfigError
from hybridflow.models.lora import SHAPE_KEYS, is_adapter
from hybridflow.stages.actor import Actor
from hybridflow.stages.base import StageContext, StageWorld
from hybridflow.stages.rollout.hf import HFRollout
from hybridflow.stages.rollout.native.role import NativeRollout

pytest.importorskip("peft")

LORA = {"lr": 5e-2, "lora_rank": 4, "lora_alpha": 8.0}
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "stop_on_eos": False}
BACKENDS = {
    "hf": (HFRollout, {}),
    "native": (NativeRollout, {"max_prompt_len": 16, "kv_cache_gb": 0.01}),
}


def _ctx(name: str, options: dict, roles: dict) -> StageContext:
    return StageContext(
        stage="engine",
        replica=0,
        device=torch.device("cpu"),
        seed=0,
        run_dir=Path("/nonexistent"),
        options=options,
        colocated=roles,
        world=StageWorld(role=name),
    )


def _engine(model: str, backend: str, sync: str, **rollout: object) -> tuple[Actor, object]:
    """A LoRA actor and its colocated rollout, the rollout told to hold the adapters as
    the stage host tells it (pipeline/host/setup.py) when the sync carries them."""
    cls, extra = BACKENDS[backend]
    roles: dict = {"actor": Actor(), "rollout": cls()}
    roles["rollout"].setup(_ctx("rollout", {"model": model, **GREEDY, **extra, **rollout}, roles))
    roles["actor"].setup(_ctx("actor", {"model": model, **LORA, "lora_sync": sync}, roles))
    if sync == "adapters":
        shape = {k: roles["actor"].opts.__dict__[k] for k in SHAPE_KEYS}
        roles["rollout"].hold_adapters(shape, 0)
    return roles["actor"], roles["rollout"]


def _push(actor: Actor, round_: int) -> None:
    """Two updates towards a fixed response (a new one each round): the policy moves."""
    batch = prompt_batch()
    target = [(7 + 3 * round_ + 2 * i) % 150 + 20 for i in range(6)]
    batch["response_ids"] = torch.tensor([target] * 3)
    batch["response_mask"] = torch.ones(3, 6, dtype=torch.int64)
    batch["advantages"] = torch.ones(3, 6)
    for _ in range(2):
        actor.handle("update", batch, {})
        actor.handle("optimizer_step", {}, {})


def _greedy(rollout: object) -> dict[str, torch.Tensor]:
    out, _ = rollout.handle("generate", prompt_batch(), {"seed": 0})  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize("backend", ["hf", "native"])
@pytest.mark.parametrize("model", ["tiny", "tiny-qwen3", "tiny-llama"])
def test_unmerged_adapters_decode_as_the_merged_weights_after_each_sync(model, backend):
    merged_actor, merged = _engine(model, backend, "merged")
    actor, unmerged = _engine(model, backend, "adapters")
    base = _greedy(unmerged)["response_ids"]
    sent = []
    for r in range(3):
        _push(merged_actor, r)
        _push(actor, r)
        merged_actor.handle("reshard", {}, {})
        _, m = actor.handle("reshard", {}, {})
        sent.append(m)
        a, b = _greedy(merged), _greedy(unmerged)
        assert torch.equal(a["response_ids"], b["response_ids"]), (model, backend, r)
        torch.testing.assert_close(a["rollout_logprobs"], b["rollout_logprobs"], atol=1e-4, rtol=0)
    assert not torch.equal(base, b["response_ids"])  # the adapters changed the policy
    # The first sync is the whole wrapped model (base_layer, adapters, the rest), the
    # next ones the adapters only.
    assert [m["reshard/adapters_only"] for m in sent] == [0.0, 1.0, 1.0]
    n_adapters = sum(is_adapter(n) for n, _ in actor.model.named_parameters())
    assert sent[1]["reshard/tensors"] == n_adapters < sent[0]["reshard/tensors"]
    assert sent[1]["reshard/bytes"] * 5 < sent[0]["reshard/bytes"]
    # The rollout's adapters are the actor's, not a copy of its merged weights.
    mine = dict(unmerged_model(unmerged).named_parameters())
    for n, p in actor.model.named_parameters():
        assert torch.equal(mine[n], p), n


def unmerged_model(rollout: object) -> torch.nn.Module:
    engine = getattr(rollout, "engine", None)
    return engine.core.model.hf if engine is not None else rollout.model  # type: ignore[attr-defined]


def test_the_base_comes_from_the_first_sync_not_from_the_rollouts_own_build():
    """A rollout built with another init seed holds another base: the first (full) sync
    replaces it, so the unmerged rollout still decodes as the actor's merged weights."""
    merged_actor, merged = _engine("tiny", "hf", "merged")
    actor, unmerged = _engine("tiny", "hf", "adapters", init_seed=5)
    _push(merged_actor, 0)
    _push(actor, 0)
    merged_actor.handle("reshard", {}, {})
    actor.handle("reshard", {}, {})
    assert torch.equal(_greedy(merged)["response_ids"], _greedy(unmerged)["response_ids"])


def test_adapter_only_updates_need_a_full_one_first_and_merged_ones_zero_the_adapters():
    actor, rollout = _engine("tiny", "hf", "adapters", init_seed=5)
    _push(actor, 0)
    with pytest.raises(BatchError, match="does not hold the actor's base"):
        rollout.update_weights(actor.named_weights("adapters"))
    with pytest.raises(BatchError, match="generate"):  # never samples a refused update
        _greedy(rollout)
    # A merged update (a checkpoint's policy on resume) lands in the base layers ...
    rollout.update_weights(actor.named_weights("merged"))
    plain = make_role(HFRollout, "plain", {"model": "tiny", **GREEDY})
    plain.update_weights(actor.named_weights("merged"))
    assert torch.equal(_greedy(rollout)["response_ids"], _greedy(plain)["response_ids"])
    # ... and the base slot is a policy then: adapters alone are refused until a full one.
    with pytest.raises(BatchError, match="does not hold the actor's base"):
        rollout.update_weights(actor.named_weights("adapters"))
    rollout.update_weights(actor.named_weights("full"))
    rollout.update_weights(actor.named_weights("adapters"))
    assert torch.equal(_greedy(rollout)["response_ids"], _greedy(plain)["response_ids"])
    half = [(n, t) for n, t in actor.named_weights("adapters") if ".lora_B." in n]
    with pytest.raises(BatchError, match="incomplete update"):
        rollout.update_weights(half)


def test_lora_sync_adapters_without_lora_is_named():
    with pytest.raises(ConfigError) as err:
        make_role(Actor, "actor", {"model": "tiny", "lora_sync": "adapters"})
    assert "lora_sync" in err.value.path and "lora_rank" in str(err.value)
    with pytest.raises(ConfigError, match="lora_sync"):
        make_role(Actor, "actor", {"model": "tiny", **LORA, "lora_sync": "adapter"})


def test_bytes_per_sync_adapters_against_merged_for_tiny_and_a_qwen2_05b_shape(capsys):
    """The bench's numbers (bench/lora_reshard.py): the tiny model measured, the Qwen2-0.5B
    shape counted on the meta device (nothing allocated, nothing downloaded)."""
    path = Path(__file__).parents[2] / "bench" / "lora_reshard.py"
    spec = importlib.util.spec_from_file_location("lora_reshard", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--presets", "tiny", "--sync", "adapters", "--ranks", "8", "64", "--reps", "1"]
    assert bench.main([*argv, "--shapes", "qwen2-0.5b"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tiny = {r["lora_rank"]: r for r in rows if r["preset"] == "tiny"}
    shape = {r["lora_rank"]: r for r in rows if r["preset"] == "qwen2-0.5b"}
    for r in tiny.values():
        assert r["sent_bytes"] < r["first_bytes"]
    assert tiny[8]["sent_bytes"] * 5 < tiny[8]["first_bytes"]
    for r in shape.values():  # fp32: the merged sync is the model's 494M parameters
        assert r["merged_bytes"] == 494_032_768 * 4
        assert r["merged_bytes"] < r["first_bytes"] < r["merged_bytes"] * 1.2
    assert shape[8]["adapter_bytes"] * 100 < shape[8]["merged_bytes"]
    assert shape[64]["adapter_bytes"] * 10 < shape[64]["merged_bytes"]
    with capsys.disabled():  # the numbers, for the report (pytest -s shows them)
        for r in rows:
            every = r.get("merged_bytes", r.get("first_bytes"))
            print(
                f"\n{r['preset']} r{r['lora_rank']}: full {every} B, then adapters "
                f"{r['adapter_bytes']} B per sync",
                end="",
            )


def test_an_aliasing_native_rollout_shares_the_actors_base_and_adapters():
    """Colocated with `alias_weights`, the full sync makes the engine's parameters the
    actor's tensors (no second copy of the base), and the adapter-only syncs that follow
    are no-ops on storage; decode still equals a merged rollout's."""
    merged_actor, merged = _engine("tiny", "native", "merged")
    actor, native = _engine("tiny", "native", "adapters", alias_weights=True)
    for r in range(2):
        _push(merged_actor, r)
        _push(actor, r)
        merged_actor.handle("reshard", {}, {})
        actor.handle("reshard", {}, {})
        assert torch.equal(_greedy(merged)["response_ids"], _greedy(native)["response_ids"])
    mine = dict(unmerged_model(native).named_parameters())
    for n, p in actor.model.named_parameters():
        assert mine[n].data_ptr() == p.data_ptr(), n

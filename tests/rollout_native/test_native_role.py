"""The `native` rollout role: the hf backend's contract, concurrent generate calls,
weight updates (copied, streamed, aliased, refused in flight), sleep/wake, option errors."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from native_helpers import ctx

from hybridflow.errors import BatchError, ConfigError
from hybridflow.stages.rollout.hf import HFRollout
from hybridflow.stages.rollout.native.role import NativeRollout, forced_lengths

OPTS = {"max_new_tokens": 12}  # options the hf backend shares
NATIVE = {**OPTS, "max_prompt_len": 16, "kv_cache_gb": 0.01}


def role(**options: Any) -> NativeRollout:
    r = NativeRollout()
    r.setup(ctx({**NATIVE, **options}))
    return r


@pytest.fixture
def native() -> Any:
    r = role()
    yield r
    r.close()


def batch(rows: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 7, (rows,), generator=g)
    width = int(lengths.max())
    ids = torch.randint(2, 190, (rows, width), generator=g)
    mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).to(torch.int64)
    return {"prompt_ids": ids * mask, "prompt_mask": mask}


def test_generate_has_the_hf_contract_and_greedy_equals_hf(native: NativeRollout) -> None:
    b = batch(4)
    params = {"temperature": 0.0, "seed": 1}
    out, metrics = native.handle("generate", b, params)
    hf = HFRollout()
    hf.setup(ctx(OPTS))
    ref, ref_metrics = hf.handle("generate", b, params)
    assert set(out) == set(ref) and set(ref_metrics) <= set(metrics)
    for key in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_index"):
        assert out[key].dtype == ref[key].dtype and torch.equal(out[key], ref[key]), key
    assert out["rollout_logprobs"].dtype == torch.float32
    assert torch.allclose(out["rollout_logprobs"], ref["rollout_logprobs"], atol=1e-5)
    mask = out["response_mask"].bool()
    assert bool((out["response_ids"][~mask] == native.pad_id).all())
    assert bool((out["rollout_logprobs"][~mask] == 0).all())


def test_n_samples_group_index_and_seeds(native: NativeRollout) -> None:
    b = batch(2)
    out, _ = native.handle("generate", b, {"n": 3, "seed": 7})
    assert out["response_ids"].shape[0] == 6
    assert out["group_index"].tolist() == [0, 0, 0, 1, 1, 1]
    assert torch.equal(out["prompt_ids"], b["prompt_ids"].repeat_interleave(3, 0))
    again, _ = native.handle("generate", b, {"n": 3, "seed": 7})
    assert torch.equal(again["response_ids"], out["response_ids"])
    other, _ = native.handle("generate", b, {"n": 3, "seed": 8})
    assert not torch.equal(other["response_ids"], out["response_ids"])


def test_concurrent_generate_calls_equal_sequential_ones(native: NativeRollout) -> None:
    calls = [(batch(3, seed=s), {"seed": 10 + s, "n": 2}) for s in range(4)]
    alone = [native.handle("generate", b, p)[0] for b, p in calls]

    async def together() -> list[Any]:
        return await asyncio.gather(*(native.generate(b, p) for b, p in calls))

    for (out, _), ref in zip(asyncio.run(together()), alone, strict=True):
        assert torch.equal(out["response_ids"], ref["response_ids"])
        assert torch.allclose(out["rollout_logprobs"], ref["rollout_logprobs"], atol=1e-5)


def _weights(r: NativeRollout, scale: float = 1.0) -> dict[str, torch.Tensor]:
    model = r.engine.core.model.hf  # type: ignore[union-attr]
    return {n: p.detach() * scale for n, p in model.named_parameters()}


def test_update_weights_while_in_flight_is_refused(native: NativeRollout) -> None:
    weights = _weights(native)

    async def scenario() -> None:
        task = asyncio.ensure_future(native.generate(batch(2), {"max_new_tokens": 12}))
        await asyncio.sleep(0)  # the request is submitted
        with pytest.raises(BatchError, match="in flight"):
            native.update_weights(iter(weights.items()), version=1)
        with pytest.raises(BatchError, match="in flight"):
            native.handle("sleep", {}, {})
        await task

    asyncio.run(scenario())
    metrics = native.update_weights(iter(weights.items()), version=1)
    assert metrics["reshard/tensors"] == len(weights) and native.policy_version == 1


def test_updates_change_generation_and_incomplete_ones_block_it(native: NativeRollout) -> None:
    b, greedy = batch(2), {"temperature": 0.0}
    before = native.handle("generate", b, greedy)[0]["response_ids"]
    new = _weights(native, scale=1.5)
    names = list(new)
    native.handle("load_weights", {k: new[k] for k in names[:3]}, {"last": False})
    with pytest.raises(BatchError, match="in progress"):
        native.handle("generate", b, greedy)
    native.handle("load_weights", {k: new[k] for k in names[3:]}, {"last": True, "version": 4})
    after = native.handle("generate", b, greedy)[0]["response_ids"]
    assert native.policy_version == 4 and not torch.equal(after, before)
    with pytest.raises(BatchError, match="incomplete"):
        native.update_weights(iter(list(new.items())[:-1]))
    with pytest.raises(BatchError, match="failed or was incomplete"):
        native.handle("generate", b, greedy)
    with pytest.raises(BatchError, match="unknown parameter"):
        native.update_weights(iter([("nope", torch.zeros(1))]))


def test_alias_weights_shares_the_actor_tensors() -> None:
    r = role(alias_weights=True)
    try:
        actor = {n: t.clone() for n, t in _weights(r).items()}
        r.update_weights(iter(actor.items()), version=1)
        params = dict(r.engine.core.model.hf.named_parameters())  # type: ignore[union-attr]
        assert all(params[n].data_ptr() == actor[n].data_ptr() for n in actor)
        b, greedy = batch(2), {"temperature": 0.0}
        before = r.handle("generate", b, greedy)[0]["response_ids"]
        for t in actor.values():  # the actor trains in place: the engine sees it
            t.mul_(1.5)
        assert not torch.equal(r.handle("generate", b, greedy)[0]["response_ids"], before)
    finally:
        r.close()


def test_sleep_releases_the_cache_and_wake_restores_it(native: NativeRollout) -> None:
    b = batch(2)
    ref = native.handle("generate", b, {"seed": 3})[0]
    _, m = native.handle("sleep", {}, {})
    assert m["rollout/kv_freed_gb"] > 0 and not native.engine.core.allocated  # type: ignore[union-attr]
    with pytest.raises(BatchError, match="asleep"):
        native.handle("generate", b, {"seed": 3})
    native.handle("wake_up", {}, {})
    assert torch.equal(
        native.handle("generate", b, {"seed": 3})[0]["response_ids"], ref["response_ids"]
    )
    with pytest.raises(BatchError, match="unknown op"):
        native.handle("train", {}, {})


def test_bad_options_name_the_key(tmp_path: Any, tokenizer: Any) -> None:
    with pytest.raises(ConfigError) as err:
        role(kv_cache_gb=1e-7)
    assert err.value.path == "stages.rollout.options.kv_cache_gb"
    with pytest.raises(ConfigError) as err:
        role(max_num_seqs=0)
    assert err.value.path == "stages.rollout.options.max_num_seqs"
    from transformers import GPT2Config, GPT2LMHeadModel

    from hybridflow.models.loader import save_pretrained

    cfg = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64)
    save_pretrained(GPT2LMHeadModel(cfg), tokenizer, tmp_path / "gpt2")
    with pytest.raises(ConfigError) as err:
        role(model=str(tmp_path / "gpt2"), model_overrides={}, max_prompt_len=8)
    assert err.value.path == "stages.rollout.options.model" and "gpt2" in str(err.value)


def test_ops_are_declared_with_the_stage_contract() -> None:
    from hybridflow.stages.contract import Scope

    ops = NativeRollout.ops
    assert set(ops) == {"generate", "load_weights", "sleep", "wake_up"}
    assert ops["generate"].concurrent and ops["generate"].scope == Scope.MICRO_BATCH
    assert set(ops["generate"].outputs or ()) == set(HFRollout.ops["generate"].outputs or ())
    assert all(
        ops[k].scope == Scope.STEP and not ops[k].concurrent
        for k in ("sleep", "wake_up", "load_weights")
    )


def test_forced_lengths_stop_each_row_at_its_drawn_length() -> None:
    """The benchmark knob: per-row log-normal lengths, capped, from the call's seed only;
    the tokens before a row's stop are those an uncapped call samples."""
    r = role(forced_length_median=5, forced_length_sigma=1.0, stop_on_eos=False, n=4)
    free = role(stop_on_eos=False, n=4)
    try:
        b, params = batch(3), {"seed": 7}
        out, _ = r.handle("generate", b, params)
        again, _ = r.handle("generate", b, params)
        full, _ = free.handle("generate", b, params)
        lengths = out["response_mask"].sum(1)
        assert r.opts is not None
        assert lengths.tolist() == forced_lengths(r.opts, 12, 7)
        assert torch.equal(again["response_ids"], out["response_ids"])
        assert len(set(lengths.tolist())) > 2 and int(lengths.max()) <= 12
        for i, n in enumerate(lengths.tolist()):
            assert torch.equal(out["response_ids"][i, :n], full["response_ids"][i, :n])
    finally:
        r.close()
        free.close()
    with pytest.raises(ConfigError, match="forced_length_median"):
        role(forced_length_median=-1)


def test_per_row_caps_must_fit_the_request(native: NativeRollout) -> None:
    from hybridflow.stages.rollout.native.request import Request, SamplingParams

    assert native.engine is not None
    prompts = [torch.tensor([3, 4, 5])]
    for caps in ([1, 2], [0], [13]):
        with pytest.raises(BatchError, match="one cap per row"):
            native.engine.call(
                lambda core, c=caps: core.add_request(
                    Request(prompts, SamplingParams(max_new_tokens=12), 0, max_new_tokens=c)
                )
            )

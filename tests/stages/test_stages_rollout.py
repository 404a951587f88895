"""HFRollout against its contract: shapes, EOS, n samples, seeds, log-probs, weight loading."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch
from stage_helpers import PROMPTS, TOK, make_role, prompt_batch, sequences

from hybridflow.data import collate_sft
from hybridflow.errors import BatchError, ConfigError
from hybridflow.stages.actor import Actor
from hybridflow.stages.rollout import hf as hf_module
from hybridflow.stages.rollout.hf import HFRollout
from hybridflow.stages.rollout.merge import CallMerger


@pytest.fixture(scope="module")
def rollout():
    return make_role(HFRollout, "rollout", {"model": "tiny", "n": 3, "max_new_tokens": 5})


def _check_layout(out, n_prompts, n, eos_ids):
    rows = n_prompts * n
    r = out["response_ids"].shape[1]
    assert out["prompt_ids"].shape[0] == rows and out["response_mask"].shape == (rows, r)
    assert (
        out["rollout_logprobs"].shape == (rows, r)
        and out["rollout_logprobs"].dtype == torch.float32
    )
    assert out["group_index"].tolist() == [i for i in range(n_prompts) for _ in range(n)]
    mask = out["response_mask"]
    lengths = mask.sum(-1)
    for row in range(rows):
        k = int(lengths[row])
        assert mask[row].tolist() == [1] * k + [0] * (r - k)  # a prefix of ones
        assert bool((out["response_ids"][row, k:] == TOK.pad_token_id).all())
        assert bool((out["rollout_logprobs"][row, k:] == 0).all())
        assert bool((out["rollout_logprobs"][row, :k] < 0).all())
        ended_early = k < r
        assert not ended_early or int(out["response_ids"][row, k - 1]) in eos_ids


def test_generate_layout_and_n_samples(rollout):
    batch = prompt_batch()
    out, metrics = rollout.handle("generate", batch, {"step": 0, "mb_id": 0})
    _check_layout(out, 3, 3, rollout.eos_ids)
    assert torch.equal(out["prompt_ids"][3:6], batch["prompt_ids"][1:2].expand(3, -1))
    assert metrics["rollout/tokens"] == float(out["response_mask"].sum())
    # Per-call overrides: n and max_new_tokens.
    out, _ = rollout.handle("generate", batch, {"n": 2, "max_new_tokens": 2})
    _check_layout(out, 3, 2, rollout.eos_ids)
    assert out["response_ids"].shape[1] <= 2


def test_stops_on_eos():
    free = make_role(
        HFRollout,
        "r",
        {"model": "tiny", "temperature": 0.0, "max_new_tokens": 6, "stop_on_eos": False},
    )
    full, _ = free.handle("generate", prompt_batch(), {})
    stop_token = int(full["response_ids"][0, 1])  # row 0's second greedy token
    stopping = make_role(
        HFRollout,
        "r",
        {"model": "tiny", "temperature": 0.0, "max_new_tokens": 6, "eos_token_id": stop_token},
    )
    out, _ = stopping.handle("generate", prompt_batch(), {})
    _check_layout(out, 3, 1, [stop_token])
    for row in range(3):
        seq = full["response_ids"][row].tolist()
        k = seq.index(stop_token) + 1 if stop_token in seq else 6
        assert int(out["response_mask"][row].sum()) == k
        assert out["response_ids"][row, :k].tolist() == seq[:k]
    assert int(out["response_mask"][0].sum()) <= 2


def test_sampling_is_seeded_per_step_and_micro_batch(rollout):
    batch = prompt_batch()
    a, _ = rollout.handle("generate", batch, {"step": 4, "mb_id": 1})
    b, _ = rollout.handle("generate", batch, {"step": 4, "mb_id": 1})
    c, _ = rollout.handle("generate", batch, {"step": 4, "mb_id": 2})
    other = make_role(
        HFRollout, "rollout", {"model": "tiny", "n": 3, "max_new_tokens": 5}, replica=1
    )
    d, _ = other.handle("generate", batch, {"step": 4, "mb_id": 1})
    assert torch.equal(a["response_ids"], b["response_ids"])
    assert torch.equal(a["response_ids"], d["response_ids"])  # replica-independent
    assert not torch.equal(a["response_ids"], c["response_ids"])
    # The n samples of one prompt differ from each other.
    assert len({tuple(r) for r in a["response_ids"][:3].tolist()}) > 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logprobs_match_the_actors_recomputation(temperature):
    rollout = make_role(
        HFRollout, "r", {"model": "tiny", "n": 4, "max_new_tokens": 6, "temperature": temperature}
    )
    actor = make_role(Actor, "a", {"model": "tiny", "temperature": temperature})
    out, _ = rollout.handle("generate", prompt_batch(), {"step": 0, "mb_id": 0})
    recomputed, _ = actor.handle("get_logprob", sequences(out), {})
    mask = out["response_mask"].bool()
    diff = (recomputed["old_logprobs"] - out["rollout_logprobs"])[mask].abs().max()
    assert float(diff) < 1e-4


def test_truncated_sampling_reports_the_truncated_distribution():
    actor = make_role(Actor, "a", {"model": "tiny"})
    greedy = make_role(HFRollout, "r", {"model": "tiny", "temperature": 0.0, "max_new_tokens": 4})
    top1 = make_role(HFRollout, "r", {"model": "tiny", "top_k": 1, "n": 2, "max_new_tokens": 4})
    g, _ = greedy.handle("generate", prompt_batch(), {})
    t, _ = top1.handle("generate", prompt_batch(), {})
    assert torch.equal(t["response_ids"][::2], g["response_ids"])  # top-1 sampling is greedy
    assert bool((t["rollout_logprobs"] == 0).all())  # from a point mass
    # Greedy reports log-probs at temperature 1, like the vllm backend.
    lp, _ = actor.handle("get_logprob", sequences(g), {})
    assert float((lp["old_logprobs"] - g["rollout_logprobs"]).abs().max()) < 1e-4
    nucleus = make_role(
        HFRollout, "r", {"model": "tiny", "top_p": 0.3, "n": 4, "max_new_tokens": 4}
    )
    out, _ = nucleus.handle("generate", prompt_batch(), {})
    lp, _ = actor.handle("get_logprob", sequences(out), {})
    mask = out["response_mask"].bool()
    # Renormalised over the nucleus: never below the untruncated log-prob.
    assert bool((out["rollout_logprobs"][mask] >= lp["old_logprobs"][mask] - 1e-5).all())


def test_bad_inputs_are_batch_errors(rollout):
    batch = prompt_batch()
    right = {"prompt_ids": batch["prompt_ids"].flip(1), "prompt_mask": batch["prompt_mask"].flip(1)}
    with pytest.raises(BatchError, match="left-padded"):
        rollout.handle("generate", right, {})
    with pytest.raises(BatchError, match="lacks"):
        rollout.handle("generate", {"prompt_ids": batch["prompt_ids"]}, {})
    with pytest.raises(BatchError, match="top_p"):
        rollout.handle("generate", batch, {"top_p": 1.5})
    with pytest.raises(BatchError, match="outside the vocabulary"):
        rollout.handle("generate", {**batch, "prompt_ids": batch["prompt_ids"] + 1000}, {})
    with pytest.raises(BatchError, match="unknown op"):
        rollout.handle("train", batch, {})
    with pytest.raises(ConfigError, match=r"stages\.r\.options\.n"):
        make_role(HFRollout, "r", {"model": "tiny", "temperature": 0.0, "n": 2})
    with pytest.raises(ConfigError, match=r"stages\.r\.options\.max_new_token"):
        make_role(HFRollout, "r", {"model": "tiny", "max_new_token": 2})


def _hf_greedy(model, batch, max_new_tokens):
    out = model.generate(
        input_ids=batch["prompt_ids"],
        attention_mask=batch["prompt_mask"],
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=TOK.eos_token_id,
        pad_token_id=TOK.pad_token_id,
    )
    return out[:, batch["prompt_ids"].shape[1] :]


def test_load_weights_makes_rollout_generate_what_the_actor_generates():
    opts = {"model": "tiny", "temperature": 0.0, "max_new_tokens": 6}
    rollout = make_role(HFRollout, "rollout", {**opts, "init_seed": 1})
    actor = make_role(Actor, "actor", {"model": "tiny", "lr": 1e-2}, colocated={"rollout": rollout})
    # A random tied-embedding model greedily repeats the prompt's last token whatever its
    # seed; a few SFT steps make the actor's greedy output its own.
    sft = collate_sft([{"prompt": p, "response": "odd 1"} for p in PROMPTS], TOK)
    for _ in range(3):
        actor.handle("sft_update", sft, {})
        actor.handle("optimizer_step", {}, {})
    batch = prompt_batch()
    expected = _hf_greedy(actor.model, batch, 6)
    before, _ = rollout.handle("generate", batch, {})
    assert not torch.equal(before["response_ids"], expected)
    _, metrics = actor.handle("reshard", {}, {})  # colocated, in process
    assert metrics["reshard/tensors"] > 0 and rollout.policy_version == 3
    after, _ = rollout.handle("generate", batch, {})
    assert torch.equal(after["response_ids"], expected)

    # Disaggregated: buckets as batches of named tensors, the last one flagged.
    remote = make_role(HFRollout, "rollout", {**opts, "init_seed": 3})
    buckets = list(actor.weight_buckets(bucket_bytes=60_000))
    assert len(buckets) > 2
    for i, bucket in enumerate(buckets):
        remote.handle(
            "load_weights",
            {k: v.clone() for k, v in bucket.items()},
            {"last": i == len(buckets) - 1, "version": 7},
        )
    assert remote.policy_version == 7
    out, _ = remote.handle("generate", batch, {})
    assert torch.equal(out["response_ids"], expected)
    exported, m = actor.handle("export_weights", {}, {"bucket": 0})
    assert m["weights/num_buckets"] == 1.0 and set(exported) == {
        n for n, _ in actor.named_weights()
    }


def test_incomplete_or_bad_weight_updates_block_generation():
    rollout = make_role(HFRollout, "rollout", {"model": "tiny", "max_new_tokens": 2})
    actor = make_role(Actor, "actor", {"model": "tiny"})
    first = next(actor.weight_buckets(bucket_bytes=60_000))
    with pytest.raises(BatchError, match="incomplete update"):
        rollout.handle("load_weights", first, {"last": True})
    with pytest.raises(BatchError, match="failed or was incomplete"):
        rollout.handle("generate", prompt_batch(), {})
    rollout.handle("load_weights", first, {"last": False})
    with pytest.raises(BatchError, match="in progress"):
        rollout.handle("generate", prompt_batch(), {})
    with pytest.raises(BatchError, match="unknown parameter"):
        rollout.handle("load_weights", {"nope.weight": torch.zeros(1)}, {"last": True})
    name, t = next(actor.named_weights())
    with pytest.raises(BatchError, match="expects"):
        rollout.handle("load_weights", {name: t[:1]}, {"last": True})
    rollout.update_weights(actor.named_weights(), version=1)  # a complete update recovers
    out, _ = rollout.handle("generate", prompt_batch(), {})
    assert out["response_ids"].shape[0] == 3


def test_finished_rows_leave_the_forward_and_the_samples_stay(monkeypatch):
    """Rows that finished leave the decode forward (hf._shrink, the KV cache cut with
    them); sampling still draws for every row, so the tokens are those of a forward over
    all rows."""
    base = {"model": "tiny", "n": 8, "max_new_tokens": 24, "temperature": 1.0}
    params = {"step": 0, "mb_id": 0}
    probe = make_role(HFRollout, "rollout", {**base, "stop_on_eos": False})
    out, _ = probe.handle("generate", prompt_batch(), params)
    common = int(torch.mode(out["response_ids"].flatten()).values)  # a frequent token: EOS
    role = make_role(HFRollout, "rollout", {**base, "eos_token_id": common})
    rows, real = [], hf_module._shrink

    def spy(cache, live, finished):
        got = real(cache, live, finished)
        rows.append(got.numel())
        return got

    monkeypatch.setattr(hf_module, "_shrink", spy)
    monkeypatch.setattr(hf_module, "SHRINK_SHARE", 10**9)  # every finished row leaves at once
    shrunk, _ = role.handle("generate", prompt_batch(), params)
    assert min(rows) < 3 * 8 and rows == sorted(rows, reverse=True)
    monkeypatch.setattr(hf_module, "SHRINK_SHARE", 0)  # none leaves
    rows.clear()
    whole, _ = role.handle("generate", prompt_batch(), params)
    assert set(rows) == {3 * 8}
    lengths = shrunk["response_mask"].sum(-1)
    assert int(lengths.min()) < int(lengths.max())  # rows did finish at different steps
    for key in ("response_ids", "response_mask"):
        assert torch.equal(shrunk[key], whole[key]), key
    torch.testing.assert_close(shrunk["rollout_logprobs"], whole["rollout_logprobs"])


# -- calls sent together run as one (rollout/merge.py) -----------------------------------


def _together(role, calls):
    """The calls' generate coroutines awaited together on one loop, as the stage host
    runs a concurrent op's tasks."""
    fn = role.bound_op(type(role).op_spec("generate"))

    async def run():
        return await asyncio.gather(*(fn(b, p) for b, p in calls), return_exceptions=True)

    return asyncio.run(run())


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_calls_sent_together_run_as_one_and_each_gets_its_own_result(temperature):
    n = 1 if temperature == 0 else 3
    role = make_role(
        HFRollout,
        "rollout",
        {
            "model": "tiny",
            "n": n,
            "max_new_tokens": 6,
            "temperature": temperature,
            "merge_window_ms": 2.0,
        },
    )
    # Different prompt widths, so the merged run re-pads them.
    calls = [
        (prompt_batch(PROMPTS[:2]), {"step": 2, "mb_id": 0}),
        (prompt_batch(PROMPTS[2:]), {"step": 2, "mb_id": 1}),
    ]
    alone = [role.handle("generate", b, p) for b, p in calls]
    rounds = role.merger.rounds
    merged = _together(role, calls)
    assert role.merger.rounds == rounds + 1  # one forward loop for both
    for (out, metrics), (ref, ref_metrics) in zip(merged, alone, strict=True):
        assert metrics["rollout/concurrent_calls"] == 2.0
        assert ref_metrics["rollout/concurrent_calls"] == 1.0
        assert set(out) == set(ref)
        for key in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_index"):
            assert torch.equal(out[key], ref[key]), key  # its own seed's draws, its own shape
        torch.testing.assert_close(out["rollout_logprobs"], ref["rollout_logprobs"])


def test_calls_of_other_options_run_apart_and_a_failed_run_fails_its_calls(monkeypatch):
    opts = {"model": "tiny", "n": 2, "max_new_tokens": 4, "merge_window_ms": 2.0}
    role = make_role(HFRollout, "rollout", opts)
    batch = prompt_batch()
    rounds = role.merger.rounds
    outs = _together(role, [(batch, {"mb_id": 0}), (batch, {"mb_id": 1, "n": 1})])
    assert role.merger.rounds == rounds + 2
    assert [o[0]["response_ids"].shape[0] for o in outs] == [6, 3]

    def broken(*a, **kw):
        raise RuntimeError("sampler broke")

    monkeypatch.setattr(role, "_sample", broken)
    outs = _together(role, [(batch, {"mb_id": 0}), (batch, {"mb_id": 1})])
    assert all(isinstance(o, RuntimeError) and "sampler broke" in str(o) for o in outs)


def _gang(step, mb, size=2, first=0):
    return {"step": step, "mb_id": mb, "mb_gang": size, "mb_gang_first": first}


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_gang_runs_as_one_in_mb_order_whatever_arrives_first(temperature):
    """The coordinator's gang (Task params mb_gang) decodes as one loop, ordered by mb_id:
    the same bits whichever member arrives first (what resumes rely on), each member its
    own seed's tokens."""
    n = 1 if temperature == 0 else 3
    opts = {"model": "tiny", "n": n, "max_new_tokens": 6, "temperature": temperature}
    role = make_role(HFRollout, "rollout", opts)
    batches = [prompt_batch(PROMPTS[:2]), prompt_batch(PROMPTS[2:])]
    alone = [role.handle("generate", b, {"step": 5, "mb_id": m}) for m, b in enumerate(batches)]
    rounds = role.merger.rounds
    forward = _together(role, [(b, _gang(5, m)) for m, b in enumerate(batches)])
    backward = _together(role, [(b, _gang(5, m)) for m, b in reversed(list(enumerate(batches)))])
    assert role.merger.rounds == rounds + 2  # one forward loop per gang
    for (out, metrics), (back, _), (ref, _) in zip(forward, backward[::-1], alone, strict=True):
        assert metrics["rollout/concurrent_calls"] == 2.0
        assert all(torch.equal(out[k], back[k]) for k in ref)  # bit for bit
        for key in ("prompt_ids", "response_ids", "response_mask", "group_index"):
            assert torch.equal(out[key], ref[key]), key
        torch.testing.assert_close(out["rollout_logprobs"], ref["rollout_logprobs"])


def test_a_gang_member_that_fails_its_checks_does_not_hold_the_others():
    role = make_role(HFRollout, "rollout", {"model": "tiny", "n": 2, "max_new_tokens": 4})
    role.merger.gang_wait_s = 60.0  # a wait for the failed member would show
    bad = prompt_batch()
    bad["prompt_ids"] = bad["prompt_ids"] + 10**6  # ids outside the vocabulary
    t0 = time.perf_counter()
    good, failed = _together(role, [(prompt_batch(), _gang(1, 0)), (bad, _gang(1, 1))])
    assert time.perf_counter() - t0 < 30
    assert isinstance(failed, BatchError) and good[1]["rollout/concurrent_calls"] == 1.0
    off = make_role(HFRollout, "rollout", {"model": "tiny", "merge_gangs": False})
    outs = _together(off, [(prompt_batch(), _gang(1, m)) for m in range(2)])
    assert [o[1]["rollout/concurrent_calls"] for o in outs] == [1.0, 1.0]


def test_gangs_merge_on_the_cpu_by_default_and_on_a_gpu_when_asked():
    role = make_role(HFRollout, "rollout", {"model": "tiny"})
    assert role.opts.merge_gangs is None and role._gang(_gang(2, 1)) == (("gang", 2, 0), 2)
    assert role._gang({"step": 2, "mb_id": 1}) is None  # sent alone
    cpu, role.device = role.device, torch.device("cuda")  # what _gang reads of the device
    try:
        assert role._gang(_gang(2, 1)) is None  # a GPU: one loop's KV for the whole gang
        role.opts = dataclasses.replace(role.opts, merge_gangs=True)
        assert role._gang(_gang(2, 1)) is not None
    finally:
        role.device = cpu


def test_a_gang_short_of_a_member_runs_the_others_after_the_wait(caplog):
    seen = []
    merger = CallMerger(lambda items: seen.append(items) or items, 0.0, "gangs")
    merger.gang_wait_s = 0.05

    async def run():
        return await asyncio.gather(
            merger.gang("g", 3, 2, "k", "c"),
            merger.gang("g", 3, 0, "k", "a"),
            merger.gang("h", 2, 0, "k", "x"),
            merger.gang("h", 2, 1, "other", "y"),
        )

    with caplog.at_level("WARNING"):
        assert asyncio.run(run()) == ["c", "a", "x", "y"]
    assert ["a", "c"] in seen and ["x"] in seen and ["y"] in seen  # mb order; one run a key
    assert "ran with 2 of 3 members" in caplog.text
    merger.leave("z", 2)
    merger.leave("z", 2)  # every member failed its checks: nothing is kept waiting
    assert not merger._gangs
    merger.close()


def test_by_default_calls_sent_together_run_alone_bit_for_bit(rollout):
    """Calls that are not a gang (no mb_gang param) and no merge window: each call its own
    loop, so outputs are bit-identical to running it alone, whatever arrives with it."""
    calls = [
        (prompt_batch(PROMPTS[:2]), {"step": 3, "mb_id": 0}),
        (prompt_batch(), {"step": 3, "mb_id": 1}),
    ]
    alone = [rollout.handle("generate", b, p) for b, p in calls]
    rounds = rollout.merger.rounds
    for (out, metrics), (ref, _) in zip(_together(rollout, calls), alone, strict=True):
        assert metrics["rollout/concurrent_calls"] == 1.0
        assert all(torch.equal(out[k], ref[k]) for k in ref)
    assert rollout.merger.rounds == rounds


def test_a_bad_merge_window_names_its_key():
    with pytest.raises(ConfigError, match="merge_window_ms"):
        make_role(HFRollout, "rollout", {"model": "tiny", "merge_window_ms": -1})

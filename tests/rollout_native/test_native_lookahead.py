"""The engine's lookahead (engine.py "Lookahead"): a step's finished rows are read after
the next decode step is queued. The same tokens as stepping in lockstep, with slots or
paged KV, preemption and sessions; a finished row decoded once more keeps its state; the
snapshot is the flags as they were; the frontend resolves every request. On the CPU the
copies are plain reads, so these tests check the ordering, not the overlap (the GPU
tests in test_native_gpu.py check that no other host wait is left)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from native_helpers import engine, prompts, run_all, slot_cache
from test_native_paged import check_blocks, equal_outputs, paged

from hybridflow.bench import native_engine
from hybridflow.stages.rollout.native.frontend import AsyncEngine
from hybridflow.stages.rollout.native.kv_cache import Readback
from hybridflow.stages.rollout.native.request import Request, SamplingParams

STOPS = (7, 19, 33, 58, 101, 150)  # ~3% of the tiny vocabulary: rows stop at random points


def _requests(temperature: float) -> list[Request]:
    """Rows of different lengths: stop ids, per-row caps, n samples, a one-token request."""
    params = SamplingParams(temperature, max_new_tokens=30, n=2, stop_token_ids=STOPS)
    reqs = [Request(prompts(3, seed=k, lo=3, hi=30), params, seed=k) for k in range(3)]
    caps = Request(prompts(3, seed=9), SamplingParams(temperature, max_new_tokens=25), seed=9)
    reqs.append(Request(caps.prompts, caps.params, seed=9, max_new_tokens=[1, 12, 25]))
    reqs.append(Request(prompts(1, seed=5), SamplingParams(temperature, max_new_tokens=1)))
    return reqs


@pytest.mark.parametrize("layout", ["slot", "paged", "paged-preempting"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_lookahead_gives_the_lockstep_tokens(qwen: Any, layout: str, temperature: float) -> None:
    reqs = _requests(temperature)
    lockstep = run_all(engine(qwen, max_num_seqs=8, lookahead=False), reqs)
    kw: dict[str, Any] = {"max_num_seqs": 8, "lookahead": True}
    if layout == "slot":
        engines = [engine(qwen, **kw)]
    elif layout == "paged":
        engines = [paged(qwen, **kw)]
    else:  # budgets whose shortages hit rows that finished in the step before
        engines = [paged(qwen, blocks=b, **kw) for b in (6, 8, 10)]
    for eng in engines:
        assert eng.lookahead
        ids = [eng.add_request(r) for r in reqs]
        outs: dict[int, Any] = {}
        while eng.has_work():
            outs.update({o.request_id: o for o in eng.step()})
            if eng.paged is not None:
                check_blocks(eng)
        equal_outputs([outs[i] for i in ids], lockstep, atol=1e-4)
        for out, req in zip((outs[i] for i in ids), reqs, strict=True):
            for row, n in enumerate(out.lengths.tolist()):  # nothing past a stop or a cap
                toks = out.tokens[row, :n].tolist()
                assert not any(t in req.params.stop_token_ids for t in toks[:-1])
        # every retired row went through one more decode, but those a shortage's
        # settling retired before the decode was queued
        rows = sum(r.rows for r in reqs)
        if layout == "paged-preempting":
            assert eng.stats["preemptions"] > 0 and 0 < eng.stats["lookahead_rows"] <= rows
        else:
            assert eng.stats["lookahead_rows"] == rows


def test_lockstep_decodes_no_finished_row(qwen: Any) -> None:
    eng = engine(qwen, lookahead=False)
    run_all(eng, _requests(1.0))
    assert eng.stats["lookahead_rows"] == 0 and not eng.lookahead
    assert not engine(qwen).lookahead  # opt-in


def test_a_finished_row_decoded_again_keeps_its_state() -> None:
    c = slot_cache()
    rows = torch.tensor([0, 1])
    params = {"max_new": torch.tensor([2, 5]), "stop": torch.tensor([[9], [-1]])}
    c.init_rows(rows, torch.tensor([3, 4]), params)
    c.record(rows, torch.tensor([4, 4]), torch.tensor([-0.5, -0.5]))
    c.record(rows, torch.tensor([9, 5]), torch.tensor([-1.0, -1.0]))  # row 0: stop and cap
    before = {k: getattr(c, k).clone() for k in ("gen_len", "positions", "tokens", "done")}
    assert before["done"].tolist() == [True, False]
    c.record(rows, torch.tensor([6, 6]), torch.tensor([-2.0, -2.0]))  # the lookahead step
    assert c.gen_len.tolist() == [2, 3] and c.positions.tolist() == [5, 7]
    assert c.tokens.tolist() == [9, 6] and c.done.tolist() == [True, False]
    assert c.out_tok[0, :2].tolist() == [4, 9] and c.out_lp[0, :2].tolist() == [-0.5, -1.0]
    assert c.out_tok[1, :3].tolist() == [4, 5, 6]


def test_the_snapshot_is_the_flags_when_taken() -> None:
    rb = Readback(torch.device("cpu"))
    done = torch.tensor([False, True, False, True])
    assert rb.take() == [] and not rb.pending
    rb.snapshot(done)
    done[0] = True  # later work: not in the snapshot
    assert rb.pending and rb.take() == [1, 3] and rb.take() == []
    gen, toks = rb.rows([3, 1], torch.tensor([5, 6, 7, 8]), torch.arange(8).view(4, 2))
    assert gen.tolist() == [8, 6] and toks.tolist() == [[6, 7], [2, 3]]
    rb.snapshot(done)
    rb.clear()
    assert not rb.pending


def test_sessions_and_drops_through_the_frontend(qwen: Any) -> None:
    """Multi-turn requests, parked sessions dropped between steps while rows run, and
    plain requests, through AsyncEngine: every future resolves, with lockstep's tokens."""
    params = SamplingParams(0.0, max_new_tokens=6, stop_token_ids=STOPS)
    plain = [Request(prompts(2, seed=20 + k), params, seed=k) for k in range(3)]

    def drive(core: Any) -> list[list[int]]:
        front = AsyncEngine(core)

        async def trajectory(i: int) -> list[int]:
            prompt, got = prompts(1, seed=40 + i, lo=5, hi=12)[0], []
            for turn in range(3):
                out = await front.generate(Request([prompt], params, session=("t", i)))
                toks = out.tokens[0, : int(out.lengths[0])]
                got += toks.tolist()
                prompt = torch.cat([prompt, toks, torch.tensor([11 + turn])])
            await asyncio.wrap_future(front.drop_sessions([("t", i)]))
            return got

        async def everything() -> list[list[int]]:
            outs = await asyncio.gather(
                *(trajectory(i) for i in range(4)), *(front.generate(r) for r in plain)
            )
            return [o if isinstance(o, list) else o.tokens.flatten().tolist() for o in outs]

        try:
            return asyncio.run(everything())
        finally:
            front.close()

    ahead = engine(qwen, max_num_seqs=4, lookahead=True)
    assert drive(ahead) == drive(engine(qwen, max_num_seqs=4, lookahead=False))
    assert ahead.stats["lookahead_rows"] > 0 and ahead.stats["reused_tokens"] > 0


@pytest.mark.slow
def test_the_decode_bench_runs_a_length_mix_with_rows_queued() -> None:
    """bench/native_engine's --rows (more rows than slots), --length-median (per-row
    log-normal caps) and --lookahead: both modes generate the same tokens."""
    args = "--seqs 4 --rows 16 --max-new-tokens 12 --length-median 4 --request-rows 4"
    args += " --samples 2 --kv-block-size 16 --frontend sync --lookahead"
    runs = {
        mode: native_engine.run(native_engine.parse([*args.split(), mode]))["results"][0]
        for mode in ("off", "on")
    }
    assert runs["on"]["tokens"] == runs["off"]["tokens"] < 16 * 12  # rows stop early
    assert runs["on"]["rows"] == 16 and runs["on"]["length_median"] == 4
    assert runs["on"]["lookahead"] and runs["on"]["lookahead_rows"] > 0
    assert not runs["off"]["lookahead"] and runs["off"]["lookahead_rows"] == 0

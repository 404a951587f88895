"""A turn boundary reaches the native engine as one burst (submit.TickBatcher), and slot
moves copy only the positions that can hold K/V (SlotCache.move's `upto`, the engine's
high-water mark); both leave every result what it was."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from native_helpers import engine, prompts, run_all, slot_cache

from hybridflow.stages.rollout.native.frontend import AsyncEngine, EngineClosedError
from hybridflow.stages.rollout.native.kv_cache import SlotCache
from hybridflow.stages.rollout.native.request import Request, SamplingParams
from hybridflow.stages.rollout.native.submit import TickBatcher

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def _cache() -> SlotCache:
    c = slot_cache(layers=2, head_dim=2, max_len=32, max_slots=4)
    assert c.kv is not None
    c.kv.copy_(torch.randn_like(c.kv))
    c.out_tok.copy_(torch.randint(0, 9, c.out_tok.shape))
    c.positions.copy_(torch.tensor([3, 5, 7, 9]))
    return c


def test_a_move_copies_positions_below_upto_and_every_per_slot_value() -> None:
    c = _cache()
    assert c.kv is not None
    before_kv, before_tok = c.kv.clone(), c.out_tok.clone()
    c.move([0, 3], [3, 1], upto=10)  # gather first: slot 3's old row reaches slot 1
    for s, d in ((0, 3), (3, 1)):
        assert torch.equal(c.kv[:, :, d, :, :10], before_kv[:, :, s, :, :10])
        assert torch.equal(c.kv[:, :, d, :, 10:], before_kv[:, :, d, :, 10:])  # kept
        assert torch.equal(c.out_tok[d, :10], before_tok[s, :10])
        assert torch.equal(c.out_tok[d, 10:], before_tok[d, 10:])
    assert c.positions.tolist() == [3, 9, 7, 3]
    assert torch.equal(c.kv[:, :, 0], before_kv[:, :, 0]) and torch.equal(
        c.kv[:, :, 2], before_kv[:, :, 2]
    )
    whole = _cache()
    assert whole.kv is not None
    ref = whole.kv.clone()
    whole.move([2], [0])  # no bound: the whole slot
    assert torch.equal(whole.kv[:, :, 0], ref[:, :, 2])


def _burst(eng: Any, histories: list[torch.Tensor], sessions: list[Any]) -> list[Any]:
    return run_all(
        eng, [Request([h], GREEDY, session=s) for h, s in zip(histories, sessions, strict=True)]
    )


def test_concurrent_sessions_of_different_lengths_continue_as_if_re_prefilled(qwen: Any) -> None:
    """Four sessions park and resume together, each moved by bounded copies (into the
    parking and back, in other slots than they left): same tokens as full prefills."""
    kept, again = engine(qwen), engine(qwen, keep_sessions=False)
    hist = prompts(4, seed=11, lo=2, hi=12)
    keys = [("mb", i) for i in range(4)]
    for turn in range(3):
        a, b = _burst(kept, hist, keys), _burst(again, hist, keys)
        for x, y in zip(a, b, strict=True):
            assert x.tokens.tolist() == y.tokens.tolist()
        assert 0 < kept._high <= kept.cache.max_len
        obs = prompts(4, seed=20 + turn, lo=1, hi=5)
        hist = [
            torch.cat([h, o.tokens[0, : int(o.lengths[0])], ob])
            for h, o, ob in zip(hist, a, obs, strict=True)
        ]
        hist = list(reversed(hist)) if turn == 0 else hist  # resume in another order
        keys = list(reversed(keys)) if turn == 0 else keys
    assert kept.stats["reused_tokens"] > 0
    kept.drop_sessions(keys)
    assert kept._high == 0  # nothing held: the next moves start from nothing


def _burst_from_tasks(batcher: TickBatcher, reqs: list[Request]) -> list[Any]:
    """Each request from its own task, all woken by the same timer (a turn boundary)."""

    async def one(r: Request) -> Any:
        await asyncio.sleep(0.01)
        await asyncio.sleep(0)  # some trajectories take an iteration longer
        return await batcher.generate(r)

    async def main() -> list[Any]:
        return await asyncio.gather(*(one(r) for r in reqs))

    return asyncio.run(main())


def test_a_boundary_arrives_as_one_hand_over_and_one_admission(qwen: Any) -> None:
    core = engine(qwen)
    admissions = []
    real = core._prefill
    core._prefill = lambda: admissions.append(1) or real()  # type: ignore[method-assign]
    reqs = [Request([p], GREEDY, seed=k) for k, p in enumerate(prompts(6, seed=3))]
    ref = run_all(engine(qwen), reqs)
    front = AsyncEngine(core)
    try:
        batcher = TickBatcher(front)
        outs = _burst_from_tasks(batcher, reqs)
    finally:
        front.close()
    for out, want in zip(outs, ref, strict=True):
        assert torch.equal(out.tokens, want.tokens)
    assert batcher.flushes == 1 and len(admissions) == 1


def test_a_burst_drops_ended_sessions_before_admitting_its_requests(qwen: Any) -> None:
    core = engine(qwen, max_num_seqs=2)
    run_all(core, [Request([p], GREEDY, session=i) for i, p in enumerate(prompts(2))])
    assert core.scheduler.free == 0  # both slots hold parked sessions
    front = AsyncEngine(core)

    async def main() -> list[Any]:
        batcher = TickBatcher(front)
        batcher.drop_sessions([0, 1])
        futs = [batcher.generate(Request([p], GREEDY)) for p in prompts(2, seed=9)]
        return await asyncio.gather(*futs)

    try:
        outs = asyncio.run(main())
    finally:
        front.close()
    assert len(outs) == 2
    assert core.stats["session_evictions"] == 0  # the drops freed the slots first


def test_a_closed_engine_fails_the_burst_and_a_cancelled_caller_is_not_sent(qwen: Any) -> None:
    front = AsyncEngine(engine(qwen))
    front.close()

    async def closed() -> None:
        await TickBatcher(front).generate(Request(prompts(1), GREEDY))

    with pytest.raises(EngineClosedError):
        asyncio.run(closed())

    class Recorder:
        def __init__(self) -> None:
            self.sent: list[int] = []

        def submit_many(self, requests: list[Request], drop: Any = ()) -> list[Any]:
            self.sent.append(len(requests))
            return []

    async def cancelled() -> None:
        batcher = TickBatcher(Recorder())  # type: ignore[arg-type]
        fut = batcher.generate(Request(prompts(1), GREEDY))
        fut.cancel()
        for _ in range(4):  # past the flush (two iterations: one arrived, one quiet)
            await asyncio.sleep(0)
        assert batcher.engine.sent == [] and batcher.flushes == 0  # type: ignore[attr-defined]

    asyncio.run(cancelled())


def _two_turns(batcher: TickBatcher, hist: list[torch.Tensor], delays: list[float]) -> list[Any]:
    """Each session's task sends turn 1, waits its own environment delay, sends turn 2 ->
    (turn-2 output, loop time it arrived) per session."""

    async def one(k: int) -> Any:
        loop = asyncio.get_running_loop()
        first = await batcher.generate(Request([hist[k]], GREEDY, session=k))
        await asyncio.sleep(delays[k])  # the environment call of this trajectory
        grown = torch.cat([hist[k], first.tokens[0, : int(first.lengths[0])], hist[k][:2]])
        out = await batcher.generate(Request([grown], GREEDY, session=k))
        batcher.drop_sessions([k])
        return out, loop.time()

    async def main() -> list[Any]:
        outs = await asyncio.gather(*(one(k) for k in range(len(hist))))
        await asyncio.sleep(0.01)  # the drops' hand-over
        return outs

    return asyncio.run(main())


def test_a_boundary_whose_environments_return_over_several_selects_is_one_burst(
    qwen: Any,
) -> None:
    """The engine answered every session; they come back 50-65 ms later, 3 ms apart
    (timers expiring in different `select`s). The burst waits for the last one: one hand-over per turn.
    The first rule (flush at the first quiet event-loop iteration) split this turn."""
    core = engine(qwen)
    admissions = []
    real = core._prefill
    core._prefill = lambda: admissions.append(1) or real()  # type: ignore[method-assign]
    front = AsyncEngine(core)
    try:
        batcher = TickBatcher(front, hold_s=5.0)
        bursts: list[int] = []
        submit = front.submit_many

        def counted(requests: Any, drop: Any = ()) -> Any:
            if requests:  # the drops after the last turn go as they come: they cost nothing
                bursts.append(len(requests))
            return submit(requests, drop)

        front.submit_many = counted  # type: ignore[method-assign]
        _two_turns(batcher, prompts(6, seed=5), [0.05 + 0.003 * k for k in range(6)])
    finally:
        front.close()
    assert bursts == [6, 6] and batcher.held == 0
    assert len(admissions) == 2


def test_a_session_still_away_delays_the_others_by_at_most_the_hold_bound(qwen: Any) -> None:
    front = AsyncEngine(engine(qwen))
    try:
        batcher = TickBatcher(front, hold_s=0.05)
        (fast, t_fast), (_, t_slow) = _two_turns(batcher, prompts(2, seed=8), [0.0, 1.5])
    finally:
        front.close()
    assert fast.tokens.numel() > 0
    assert batcher.held >= 1  # the fast session's turn 2 went out at the bound
    assert t_slow - t_fast > 1.0  # ... long before the slow one came back

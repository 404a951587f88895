"""Sessions of the native engine (multi-turn): a trajectory's next turn is prefilled on top
of its parked K/V, and gives what re-prefilling the whole history gives. The scheduler's
parking is replayed against random orders; the engine is checked against fresh prefills."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from native_helpers import engine, prompts, run_all

from hybridflow.errors import BatchError
from hybridflow.stages.rollout.native.request import Request, SamplingParams
from hybridflow.stages.rollout.native.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def _apply(where: dict[int, Any], moves: list[tuple[int, int]]) -> None:
    """Mirror SlotCache.move: every move reads the state before any writes."""
    taken = {src: where.get(src) for src, _ in moves}
    for src, dst in moves:
        where[dst] = taken[src]


def test_scheduler_parks_resumes_and_evicts_keeping_every_slot_where_it_says() -> None:
    for seed in range(40):
        rng = random.Random(seed)
        n_slots = rng.randint(1, 6)
        s = Scheduler(num_slots=n_slots)
        where: dict[int, Any] = {}  # slot -> ("row", rid) or ("kv", session)
        kv_of: dict[int, int] = {}  # session -> K/V positions parked
        rid, tick, live_sessions = 0, 0, set()
        for tick in range(150):
            r = rng.random()
            idle = [k for k in range(8) if k not in live_sessions]
            if r < 0.35 and idle:
                session = rng.choice(idle)
                length = rng.randint(1, 10) + kv_of.get(session, 0)
                s.add(rid, [length], 1, session)
                live_sessions.add(session)
                rid += 1
            elif r < 0.45 and kv_of:
                gone = rng.sample(sorted(kv_of), rng.randint(1, len(kv_of)))
                for moves in s.drop(gone):
                    _apply(where, moves)
                for g in gone:
                    kv_of.pop(g)
            adm = s.admit(max_prefill_tokens=rng.randint(1, 30), tick=tick)
            for moves in adm.moves:
                _apply(where, moves)
            for key in adm.evicted:
                kv_of.pop(key)
            for ref, slot, g in zip(adm.rows, adm.slots, adm.group, strict=True):
                session = s._session[ref.request_id]
                cached = adm.cached[g]
                if cached:  # its own K/V was moved into the slot it runs in
                    assert where.get(slot) == ("kv", session)
                    assert cached == min(kv_of.pop(session), s.prompt_len(ref.request_id, 0) - 1)
                else:
                    kv_of.pop(session, None)
                where[slot] = ("row", session)
            if s.active and rng.random() < 0.6:
                done = rng.sample(range(s.active), rng.randint(1, s.active))
                park = {d: rng.randint(1, 20) for d in done if rng.random() < 0.7}
                sessions = {d: where[d][1] for d in done}
                fin = s.finish(done, park)
                for d in done:
                    live_sessions.discard(sessions[d])
                    where[d] = ("kv", sessions[d]) if d in park else None
                _apply(where, fin.moves)
                for session, slot in fin.parked:
                    assert where[slot] == ("kv", session)
                for d in done:
                    if d in park:
                        kv_of[sessions[d]] = park[d]
            # running rows fill 0..active-1, parked sessions the top, nothing overlaps
            assert s.active + len(s.parked) + s.free == n_slots and s.free >= 0
            for i, session in enumerate(s.parked):
                assert where[n_slots - 1 - i] == ("kv", session)
                assert s.cached(session) == kv_of[session]
            assert sorted(kv_of) == sorted(s.parked)
            for i in range(s.active):
                assert where[i][0] == "row"


def _turns(eng: Any, first: torch.Tensor, observations: list[list[int]], session: Any) -> list:
    """Greedy turns: each next prompt = the last prompt + its output + an observation."""
    outs, prompt = [], first
    for k in range(len(observations) + 1):
        (out,) = run_all(eng, [Request([prompt], GREEDY, seed=k, session=session)])
        toks = out.tokens[0, : int(out.lengths[0])]
        outs.append((toks, out.logprobs[0, : int(out.lengths[0])]))
        if k < len(observations):
            prompt = torch.cat([prompt, toks, torch.tensor(observations[k])])
    return outs


def test_a_continued_turn_equals_re_prefilling_its_history(qwen: Any) -> None:
    obs = [[5, 6, 7], [9], [11, 12]]
    kept = engine(qwen)
    again = engine(qwen, keep_sessions=False)
    for p in prompts(3, seed=4):
        a = _turns(kept, p, obs, session=("mb", int(p[0])))
        b = _turns(again, p, obs, session=("mb", int(p[0])))
        for (ta, la), (tb, lb) in zip(a, b, strict=True):
            assert ta.tolist() == tb.tolist()
            torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-4)  # other kernels: rounding
    # every turn after the first reused its history, and computed only what was new
    assert kept.stats["reused_tokens"] > 0 and again.stats["reused_tokens"] == 0
    assert (
        kept.stats["prefill_tokens"] + kept.stats["reused_tokens"] == again.stats["prefill_tokens"]
    )


def test_eviction_and_a_changed_history_fall_back_to_a_full_prefill(qwen: Any) -> None:
    eng = engine(qwen, max_num_seqs=2)
    fresh = engine(qwen, keep_sessions=False)
    ps = prompts(3, seed=7)
    first = run_all(eng, [Request([p], GREEDY, session=i) for i, p in enumerate(ps[:2])])
    assert len(eng.sessions) == 2 and eng.scheduler.free == 0
    # a third row needs a slot: the least recently parked session goes
    run_all(eng, [Request([ps[2]], GREEDY)])
    assert eng.stats["session_evictions"] == 1 and 0 not in eng.sessions
    for i in (0, 1):  # evicted (0) and kept (1) continue exactly as from scratch
        toks = first[i].tokens[0, : int(first[i].lengths[0])]
        nxt = torch.cat([ps[i], toks, torch.tensor([3, 4])])
        (a,) = run_all(eng, [Request([nxt], GREEDY, session=i)])
        (b,) = run_all(fresh, [Request([nxt], GREEDY)])
        assert a.tokens.tolist() == b.tokens.tolist()
    # a prompt that does not extend what the session holds drops it: same answer
    reused = eng.stats["reused_tokens"]
    other = torch.cat([ps[1][:-1], torch.tensor([8, 8, 8])])
    (a,) = run_all(eng, [Request([other], GREEDY, session=1)])
    (b,) = run_all(fresh, [Request([other], GREEDY)])
    assert a.tokens.tolist() == b.tokens.tolist()
    assert eng.stats["reused_tokens"] == reused


def test_dropped_sessions_free_their_slots_and_release_drops_all(qwen: Any) -> None:
    eng = engine(qwen, max_num_seqs=3)
    run_all(eng, [Request([p], GREEDY, session=i) for i, p in enumerate(prompts(3))])
    assert eng.scheduler.free == 0
    eng.drop_sessions([0, 2, 99])  # an unknown session is ignored
    assert sorted(eng.sessions) == [1] and eng.scheduler.free == 2
    eng.release()
    assert eng.sessions == {} and eng.scheduler.parked == []
    eng.allocate()
    with pytest.raises(BatchError, match="one prompt and n = 1"):
        eng.add_request(Request(prompts(2), GREEDY, session="x"))

"""The continuous-batching state machine, replayed against random finish orders."""

from __future__ import annotations

import random

import pytest

from hybridflow.stages.rollout.native.scheduler import Scheduler


def test_rows_stay_dense_and_every_request_completes_once() -> None:
    for seed in range(30):
        rng = random.Random(seed)
        s = Scheduler(num_slots=rng.randint(1, 9))
        expected: dict[int, int] = {}
        finished: list[tuple[int, int]] = []
        completed: list[int] = []
        where: dict[int, tuple[int, int]] = {}  # slot -> row, mirrored through the moves
        start: dict[tuple[int, int], int] = {}  # row -> prompt length - admission tick
        lens_of: dict[int, list[int]] = {}
        next_id = 0
        for tick in range(200):
            if rng.random() < 0.3 and next_id < 12:
                lens = [rng.randint(1, 8) for _ in range(rng.randint(1, 3))]
                n = rng.randint(1, 3)
                s.add(next_id, lens, n)
                lens_of[next_id] = lens
                expected[next_id] = len(lens) * n
                next_id += 1
            adm = s.admit(max_prefill_tokens=rng.randint(1, 20), tick=tick)
            for ref, slot in zip(adm.rows, adm.slots, strict=True):
                assert slot not in where
                where[slot] = (ref.request_id, ref.row)
                start[(ref.request_id, ref.row)] = lens_of[ref.request_id][ref.prompt] - tick
            # The decode step `tick` writes row r at P + tick - t0: it must read one more.
            want = max((start[r] + tick + 1 for r in where.values()), default=0)
            assert s.attended(tick) == want
            assert all(
                adm.prompts[g] == (r.request_id, r.prompt)
                for r, g in zip(adm.rows, adm.group, strict=True)
            )
            if s.active and rng.random() < 0.7:
                k = rng.randint(1, s.active)
                done = rng.sample(range(s.active), k)
                fin = s.finish(done)
                finished += [(r.request_id, r.row) for r in fin.rows]
                assert [where[d] for d in done] == [(r.request_id, r.row) for r in fin.rows]
                for d in done:
                    del where[d]
                for src, dst in fin.moves:
                    assert dst not in where and src in where
                    where[dst] = where.pop(src)
                completed += fin.completed
            # Invariant: live rows fill slots 0..active-1 exactly.
            assert sorted(where) == list(range(s.active))
            assert all(where[i] == (ref.request_id, ref.row) for i, ref in enumerate(s.slots))
        while s.has_work():
            s.admit(10**6)
            fin = s.finish(list(range(s.active)))
            finished += [(r.request_id, r.row) for r in fin.rows]
            completed += fin.completed
        assert sorted(completed) == list(range(next_id))
        assert len(finished) == len(set(finished)) == sum(expected.values())


def test_admission_is_fifo_and_bounded_by_the_prefill_budget() -> None:
    s = Scheduler(num_slots=8)
    s.add(0, [4, 4], n=2)  # rows 0..3
    s.add(1, [10], n=1)
    adm = s.admit(max_prefill_tokens=8)  # two prompts of 4 fit, the 10-token one not
    assert [(r.request_id, r.row) for r in adm.rows] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert adm.prompts == [(0, 0), (0, 1)] and adm.width == 4
    adm = s.admit(max_prefill_tokens=8)  # over budget alone: still admitted (no starvation)
    assert [(r.request_id, r.row) for r in adm.rows] == [(1, 0)]
    assert adm.slots == [4]


def test_slots_cap_admission_and_bad_finish_is_refused() -> None:
    s = Scheduler(num_slots=2)
    s.add(0, [3, 3, 3], n=1)
    assert len(s.admit(100).rows) == 2 and s.free == 0
    assert s.admit(100).rows == []
    with pytest.raises(ValueError):
        s.finish([2])
    fin = s.finish([0])
    assert fin.moves == [(1, 0)] and fin.completed == []
    assert [r.row for r in s.admit(100).rows] == [2]

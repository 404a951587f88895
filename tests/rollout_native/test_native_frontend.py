"""AsyncEngine: the engine thread resolves futures, refuses calls in flight, turns a
failed step into errors of the requests it carried (and keeps going), and closes cleanly."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
from typing import Any

import pytest
import torch
from native_helpers import engine, prompts, run_all

from hybridflow.errors import BatchError
from hybridflow.stages.rollout.native.frontend import AsyncEngine, EngineClosedError
from hybridflow.stages.rollout.native.request import Request, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


def test_futures_resolve_with_the_sync_engine_results(qwen: Any) -> None:
    reqs = [Request(prompts(k, seed=k), GREEDY) for k in (2, 3, 1)]
    ref = run_all(engine(qwen), reqs)
    front = AsyncEngine(engine(qwen))
    try:

        async def all_at_once() -> list[Any]:
            return await asyncio.gather(*(front.generate(r) for r in reqs))

        for out, want in zip(asyncio.run(all_at_once()), ref, strict=True):
            assert torch.equal(out.tokens, want.tokens)
        assert front.in_flight() == 0
        assert front.call(lambda core: core.in_flight()) == 0
    finally:
        front.close()
    assert not front._thread.is_alive()
    with pytest.raises(EngineClosedError):
        front.submit(reqs[0])


def test_bad_request_fails_only_itself(qwen: Any) -> None:
    front = AsyncEngine(engine(qwen))
    try:
        bad = front.submit(Request([torch.tensor([1, 2])], SamplingParams(top_p=0.0)))
        good = front.submit(Request(prompts(1), GREEDY))
        with pytest.raises(BatchError, match="top_p"):
            bad.result(timeout=30)
        assert good.result(timeout=30).tokens.shape == (1, 10)
    finally:
        front.close()


def _break_step(core: Any, at: int) -> None:
    """`core.step` raises RuntimeError("boom") at its `at`-th call, and only then."""
    real_step, calls = core.step, {"n": 0}

    def flaky_step() -> Any:
        calls["n"] += 1
        if calls["n"] == at:
            raise RuntimeError("boom")
        return real_step()

    core.step = flaky_step


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(qwen: Any) -> None:
    core = engine(qwen)
    front = AsyncEngine(core)
    _break_step(core, at=3)
    try:
        fut = front.submit(Request(prompts(2), GREEDY))
        with pytest.raises(RuntimeError, match="boom"):
            fut.result(timeout=30)
        assert core.in_flight() == 0 and not core.has_work()
        assert front.submit(Request(prompts(2), GREEDY)).result(timeout=30).tokens.shape[0] == 2
    finally:
        front.close()


def test_close_fails_requests_still_running(qwen: Any) -> None:
    front = AsyncEngine(engine(qwen, max_model_len=512, kv_cache_gb=0.2))
    fut = front.submit(Request(prompts(2), SamplingParams(max_new_tokens=400)))
    front.close()
    with pytest.raises(EngineClosedError):
        fut.result(timeout=30)


@pytest.mark.parametrize("gather_s", [0.0, 0.5])
def test_gathering_admits_requests_arriving_together_in_one_prefill(
    qwen: Any, gather_s: float
) -> None:
    """With nothing decoding, requests arriving 20 ms apart are admitted together when the
    quiet window (gather_s) is longer than their spacing; results are the same either way."""
    import time

    core = engine(qwen)
    prefills = []
    real = core._prefill
    core._prefill = lambda: prefills.append(1) or real()  # type: ignore[method-assign]
    front = AsyncEngine(core, gather_s=gather_s, max_gather_s=2.0)
    reqs = [Request(prompts(1, seed=k), GREEDY) for k in range(3)]
    ref = run_all(engine(qwen), reqs)
    try:
        futures = []
        for r in reqs:
            futures.append(front.submit(r))
            time.sleep(0.02)
        outs = [f.result(timeout=60) for f in futures]
    finally:
        front.close()
    for out, want in zip(outs, ref, strict=True):
        assert torch.equal(out.tokens, want.tokens)
    # without the window each arrival is its own admission (two might share one drain of
    # the inbox on a loaded machine)
    assert len(prefills) == 1 if gather_s else len(prefills) > 1


# -- driven: the loop in the caller's worker thread (the CPU stage) ----------------------


class _Worker:
    """A stage's worker thread and its `StageContext.compute`, counting the drives."""

    def __init__(self) -> None:
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix="stage-worker")
        self.drives = 0

    async def compute(self, fn: Any, *args: Any) -> Any:
        self.drives += 1
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)


def test_driven_engine_steps_in_the_worker_thread_and_joins_running_drives(qwen: Any) -> None:
    """No engine thread: the first submission starts a drive in the worker thread, later
    ones join it through the inbox; results are the sync engine's; `call` runs in the
    caller's thread and is refused while requests are in flight."""
    reqs = [Request(prompts(k, seed=k), GREEDY) for k in (2, 3, 1)]
    ref = run_all(engine(qwen), reqs)
    core, worker = engine(qwen), _Worker()
    threads = set()
    real_step = core.step
    core.step = lambda: threads.add(threading.current_thread().name) or real_step()  # type: ignore[method-assign]
    front = AsyncEngine(core, driver=worker.compute)
    assert front._thread is None

    async def staggered() -> list[Any]:
        first = asyncio.ensure_future(front.generate(reqs[0]))
        await asyncio.sleep(0.05)  # the drive runs; these two join it
        rest = await asyncio.gather(*(front.generate(r) for r in reqs[1:]))
        done = [await first, *rest]
        # a result resolves inside a step; the drive ends on its next turn, so wait for it
        # before asking whether it is still driving (this raced on a loaded machine)
        await asyncio.gather(*front._drives)
        return done

    try:
        outs = asyncio.run(staggered())
        for out, want in zip(outs, ref, strict=True):
            assert torch.equal(out.tokens, want.tokens)
        assert {t.split("_")[0] for t in threads} == {"stage-worker"}
        assert worker.drives < len(reqs) and not front._driving
        assert front.call(lambda c: c.in_flight()) == 0
    finally:
        front.close()
        worker.pool.shutdown()
    with pytest.raises(EngineClosedError):
        front.submit(reqs[0])


def test_driven_engine_fails_a_broken_step_goes_on_and_closes_what_runs(qwen: Any) -> None:
    core, worker = engine(qwen, max_model_len=512, kv_cache_gb=0.2), _Worker()
    _break_step(core, at=2)
    front = AsyncEngine(core, driver=worker.compute)

    async def scenario() -> Any:
        with pytest.raises(RuntimeError, match="boom"):
            await front.generate(Request(prompts(2), GREEDY))
        ok = await front.generate(Request(prompts(2), GREEDY))
        long = asyncio.ensure_future(
            front.generate(Request(prompts(1), SamplingParams(max_new_tokens=400)))
        )
        await asyncio.sleep(0.05)
        front.close()  # the running drive fails it at its next turn
        with pytest.raises(EngineClosedError):
            await long
        return ok

    try:
        assert asyncio.run(scenario()).tokens.shape[0] == 2
        assert not front._driving and core.in_flight() == 0
    finally:
        worker.pool.shutdown()

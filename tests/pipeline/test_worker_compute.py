"""Worker.compute (StageContext.compute): a concurrent op's compute runs in the stage's
worker thread, queued behind the plain ops, and is timed as its Task's own run (the wait
for the thread excluded), as a plain op's is."""

from __future__ import annotations

import asyncio
import threading
import time

from hybridflow.pipeline.host.worker import Worker, current_task


async def test_compute_runs_in_the_worker_thread_and_times_the_current_task() -> None:
    worker = Worker("w")
    try:
        seen: list[str] = []
        worker.hold(7)
        worker.started(7)  # a concurrent op's Task
        t0 = time.perf_counter()
        plain = asyncio.ensure_future(worker.call(time.sleep, 0.5))  # holds the thread
        await asyncio.sleep(0.05)
        token = current_task.set(7)
        try:
            await worker.compute(lambda: seen.append(threading.current_thread().name))
        finally:
            current_task.reset(token)
        await plain
        assert seen and seen[0].startswith("w-worker")
        assert time.perf_counter() - t0 >= 0.5  # it waited for the plain op ...
        assert worker.ran_s(7, t0) < 0.4  # ... and that wait is not its run time
        assert worker.ran_s(8, t0) >= 0.5  # a task it never ran: wall time since t0
    finally:
        worker.shutdown()

"""The stage process's one worker thread, and the ledger of the tasks it holds.

Role code of plain ops, setup and checkpoint calls runs here, one call at a time in
order (roles need no locks), so the asyncio loop keeps the socket and the heartbeats
going while a role computes. The ledger is what heartbeats report: every Task received
and not yet answered, in arrival order, and whether it has started (the coordinator's
deadlines and lost-task check read it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any

from hybridflow.transport.liveness import Progress

# The Task a concurrent op's coroutine serves (the task runner sets it around the await),
# so what that op hands to the thread (`compute`) is timed as the task's own run.
current_task: ContextVar[int | None] = ContextVar("current_task", default=None)


class Worker:
    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-worker")
        self.busy = False  # the thread is running (or about to run) a call
        self._since = 0.0  # monotonic start of the thread's current call; 0: idle
        # Task id -> started? The thread flips its task to True when it actually starts it.
        self._held: dict[int, bool] = {}
        self._ran_s: dict[int, float] = {}  # task id -> seconds its op ran in the thread

    async def call(self, fn: Callable[..., Any], *args: Any, task_id: int | None = None) -> Any:
        """Run `fn(*args)` in the thread; `task_id`: the Task it serves, marked started
        when the thread actually starts it (not while it waits for the thread)."""

        def run() -> Any:
            self._since = start = time.monotonic()
            if task_id is not None and task_id in self._held:
                self._held[task_id] = True  # an existing key: safe from this thread
            try:
                return fn(*args)
            finally:
                self._since = 0.0
                if task_id is not None:  # the op's own time, not its wait for the thread
                    self._ran_s[task_id] = time.monotonic() - start

        self.busy = True
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, run)
        finally:
            self.busy = False

    async def compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """StageContext.compute: `fn(*args)` in the thread, timed as the current Task's
        (its wait for the thread excluded, as a plain op's)."""
        return await self.call(fn, *args, task_id=current_task.get())

    # -- the ledger ----------------------------------------------------------------------
    def hold(self, task_id: int) -> None:
        """A Task was received: held, not started."""
        self._held[task_id] = False

    def started(self, task_id: int) -> None:
        """A Task that does not go through the thread (a concurrent op, a weight sync) runs."""
        self._held[task_id] = True

    def ran_s(self, task_id: int, t0: float) -> float:
        """The seconds the Task's op ran: in the thread if it ran there (its wait for the
        thread excluded), else since `t0` (perf_counter: a concurrent op's wall time)."""
        ran = self._ran_s.pop(task_id, None)
        return time.perf_counter() - t0 if ran is None else ran

    def release(self, task_id: int) -> None:
        """A Task was answered (or failed)."""
        self._held.pop(task_id, None)
        self._ran_s.pop(task_id, None)

    def progress(self) -> Progress:
        """What the heartbeat reports: tasks running, tasks queued, thread busy seconds."""
        held = list(self._held.items())
        since = self._since
        busy_s = time.monotonic() - since if since else 0.0
        return [t for t, on in held if on], [t for t, on in held if not on], busy_s

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)

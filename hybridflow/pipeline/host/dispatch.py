"""The order in which a stage process starts its tasks (the stage contract's concurrency
rules, stages/contract.py), as a small piece of asyncio with no sockets and no roles.

    submit(run, role=R, mode=CONCURRENT)  start now; others of any kind may run beside it
    submit(run, role=R, mode=PLAIN)       wait for R's in-flight CONCURRENT tasks, then
                                          start (plain ops then queue for the stage's one
                                          worker thread, which keeps them in order)
    submit(run, mode=BARRIER)             wait for every in-flight task, run it to its end;
                                          nothing submitted later starts before that

`submit` returns once the task has started (a BARRIER: once it has finished), so a caller
that submits in arrival order gets these rules in arrival order. Step ops (optimizer
step, reshard, load_weights), weight-sync ops and Control calls are barriers: weights
never change under a running generate, and a checkpoint sees no half-done task.

Invariants: every task started here is awaited or cancelled by `close`; a task's own
errors are its business (the stage's runners report them as Failure messages), so a
failed task never blocks or fails the tasks behind it.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable


class Mode(enum.Enum):
    CONCURRENT = "concurrent"
    PLAIN = "plain"
    BARRIER = "barrier"


class Dispatcher:
    def __init__(self) -> None:
        # In-flight tasks -> (role, concurrent?), in start order.
        self._inflight: dict[asyncio.Task[None], tuple[str, bool]] = {}

    def __len__(self) -> int:
        return len(self._inflight)

    async def submit(
        self, run: Callable[[], Awaitable[None]], *, mode: Mode, role: str = "", name: str = ""
    ) -> None:
        if mode is Mode.BARRIER:
            await self._drain()
            await run()
            return
        if mode is Mode.PLAIN:
            await self._drain(role=role, concurrent_only=True)
        task = asyncio.ensure_future(run())
        if name:
            task.set_name(name)
        self._inflight[task] = (role, mode is Mode.CONCURRENT)
        task.add_done_callback(self._done)

    async def close(self) -> None:
        """Cancel what still runs and wait for it (teardown)."""
        for task in list(self._inflight):
            task.cancel()
        await asyncio.gather(*self._inflight, return_exceptions=True)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._inflight.pop(task, None)

    async def _drain(self, role: str | None = None, concurrent_only: bool = False) -> None:
        waiting = [
            t
            for t, (r, conc) in self._inflight.items()
            if (role is None or r == role) and (conc or not concurrent_only)
        ]
        if waiting:
            await asyncio.gather(*waiting, return_exceptions=True)

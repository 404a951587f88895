"""Generate calls that arrive together run as one: the `hf` backend's batching across
micro-batches.

The coordinator sends a step's micro-batches to the rollout at once. The native and vLLM
engines batch them continuously. A transformers forward loop cannot: a call decodes its
rows to the end, alone. Run one after another, M calls of B rows pay the decode loop's
per-step cost M times. On the 2-core CPU machine a step of 2 x 32 rows took 0.42-0.47 s
of rollout against 0.33 s for one call of 64 (bench/RESULTS.md). Here calls that are
queued together run as one forward loop over all their rows, in one of two ways:

    gang(gang, size, order, key, item)   the coordinator's gangs (the default): the
                        micro-batches of one op and step it sent to this replica in one
                        scheduling round (Task params mb_gang, mb_gang_first). The last
                        member to arrive runs them all, ordered by `order` (mb_id): the
                        batch is a function of the schedule, never of arrival times, so
                        runs and resumes stay bit-identical. A member whose checks failed
                        `leave`s; one that never comes is waited for `gang_wait_s`.
    submit(key, item)   opt-in (`merge_window_ms` > 0), from the event loop: queue the call
                        and await its own result. The first call of a round waits
                        `window_s` for the ones sent with it. Then every queued call of
                        its key runs as one `run([items])`. Calls arriving during that run
                        make the next round. Which calls share a loop depends on arrival
                        times and a wider batch rounds differently, so a run with it is
                        not bit-identical to another.

    call(fn, *args)     run something alone in the same thread (a call that cannot merge)

Runs go to `compute`, the stage's worker thread (StageContext.compute), where the plain
ops run too: a thread of its own made every torch op of the process slower on the CPU
machine (train 0.38 -> 0.44 s, generate 0.33 -> 0.39 s; bench/RESULTS.md). Outside a
stage process (tests, scripts) the merger makes its own thread.

Invariants: results go back to the calls that sent them, in their order; a failure of a
merged run fails each of its calls with that error; one thread runs everything, so the
model is never used by two runs at once; `close` cancels what is queued.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger("hybridflow.rollout.merge")
GANG_WAIT_S = 5.0  # members are sent back to back: a longer wait means one is lost


@dataclass
class _Gang:
    size: int  # members still expected in all (`leave` lowers it)
    members: list[tuple[int, Hashable, Any, asyncio.Future[Any]]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class CallMerger(Generic[T, R]):
    def __init__(
        self,
        run: Callable[[list[T]], list[R]],
        window_s: float,
        name: str,
        compute: Callable[..., Awaitable[Any]] | None = None,
    ) -> None:
        """`compute`: where runs go (StageContext.compute, the stage's worker thread);
        None: a thread of the merger's own (one thread either way)."""
        self._run, self.window_s, self.name = run, window_s, name
        self._pool: ThreadPoolExecutor | None = None
        if compute is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
            compute = self._in_pool
        self._compute = compute
        self._pending: list[tuple[Hashable, T, asyncio.Future[R]]] = []
        self._drainer: asyncio.Task[None] | None = None
        self._running: list[asyncio.Future[R]] = []  # the calls of the run in the thread
        self.rounds = 0  # merged runs so far (one per round, whatever its size)
        self._gangs: dict[Hashable, _Gang] = {}
        self._gang_runs: set[asyncio.Task[None]] = set()
        self.gang_wait_s = GANG_WAIT_S

    async def gang(self, gang: Hashable, size: int, order: int, key: Hashable, item: T) -> R:
        """One member (`order`: its mb_id) of coordinator gang `gang` of `size` calls;
        members of one `key` (sampling options) run as one call of `run`."""
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        g = self._gangs.setdefault(gang, _Gang(size))
        g.members.append((order, key, item, fut))
        if g.timer is None:
            g.timer = asyncio.get_running_loop().call_later(
                self.gang_wait_s, self._start_gang, gang, True
            )
        if len(g.members) >= g.size:
            self._start_gang(gang)
        return await fut

    def leave(self, gang: Hashable, size: int) -> None:
        """A member of `gang` (of `size`) that will not come: its checks failed."""
        g = self._gangs.setdefault(gang, _Gang(size))
        g.size -= 1
        if g.members and len(g.members) >= g.size:
            self._start_gang(gang)
        elif g.size <= 0:  # every member failed: nothing left to wait for
            del self._gangs[gang]

    def _start_gang(self, gang: Hashable, late: bool = False) -> None:
        g = self._gangs.pop(gang, None)
        if g is None:
            return
        if g.timer is not None:
            g.timer.cancel()
        if late:
            log.warning(
                "%s: gang %s ran with %d of %d members after %.0f s (the others never came)",
                self.name, gang, len(g.members), g.size, self.gang_wait_s,
            )  # fmt: skip
        members = sorted(g.members, key=lambda m: m[0])
        keys = list(dict.fromkeys(m[1] for m in members))  # first-seen order of mb_id
        rounds = [[(k, m[2], m[3]) for m in members if m[1] == k] for k in keys]
        task = asyncio.create_task(self._run_rounds(rounds), name=f"{self.name}.gang")
        self._gang_runs.add(task)
        task.add_done_callback(self._gang_runs.discard)

    async def _run_rounds(self, rounds: list[list[tuple[Hashable, T, asyncio.Future[R]]]]) -> None:
        for take in rounds:
            await self._round(take)

    async def submit(self, key: Hashable, item: T) -> R:
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((key, item, fut))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain(), name=f"{self.name}.merge")
        return await fut

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._compute(fn, *args)

    async def _in_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _drain(self) -> None:
        while self._pending:
            # Let the calls sent with the first one reach the loop (they were on the wire).
            await asyncio.sleep(self.window_s)
            key = self._pending[0][0]
            take = [p for p in self._pending if p[0] == key]
            self._pending = [p for p in self._pending if p[0] != key]
            await self._round(take)

    async def _round(self, take: list[tuple[Hashable, T, asyncio.Future[R]]]) -> None:
        take = [p for p in take if not p[2].done()]  # a cancelled caller
        if not take:
            return
        self.rounds += 1
        self._running = [p[2] for p in take]
        try:
            results = await self._compute(self._run, [p[1] for p in take])
        except Exception as exc:  # each merged call fails with the run's error
            for _, _, fut in take:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, _, fut), result in zip(take, results, strict=True):
            if not fut.done():
                fut.set_result(result)

    def close(self) -> None:
        if self._drainer is not None:
            self._drainer.cancel()
        for task in list(self._gang_runs):
            task.cancel()
        gangs = [m[3] for g in self._gangs.values() for m in g.members]
        for g in self._gangs.values():
            if g.timer is not None:
                g.timer.cancel()
        for fut in [*self._running, *(p[2] for p in self._pending), *gangs]:
            fut.cancel()
        self._pending.clear()
        self._gangs.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

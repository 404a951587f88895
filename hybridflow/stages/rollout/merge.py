"""Generate calls that arrive together run as one: the `hf` backend's batching across
micro-batches.

The coordinator sends a step's micro-batches to the rollout at once. The native and vLLM
engines batch them continuously. A transformers forward loop cannot: a call decodes its
rows to the end, alone. Run one after another, M calls of B rows pay the decode loop's
per-step cost M times. On the 2-core CPU machine a step of 2 x 32 rows took 0.42-0.47 s
of rollout against 0.33 s for one call of 64 (bench/RESULTS.md). Here calls that are
queued together run as one forward loop over all their rows. Opt-in (`merge_window_ms`
> 0): which calls share a loop depends on arrival times and a wider batch rounds
differently, so a run with it is not bit-identical to another.

    submit(key, item)   from the event loop (a concurrent op): queue the call and await
                        its own result. The first call of a round waits `window_s` for
                        the ones sent with it. Then every queued call of its key runs as
                        one `run([items])` in its thread (below). Calls arriving during
                        that run make the next round.
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
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


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
            take = [p for p in take if not p[2].done()]  # a cancelled caller
            if not take:
                continue
            self.rounds += 1
            self._running = [p[2] for p in take]
            try:
                results = await self._compute(self._run, [p[1] for p in take])
            except Exception as exc:  # each merged call fails with the run's error
                for _, _, fut in take:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, _, fut), result in zip(take, results, strict=True):
                if not fut.done():
                    fut.set_result(result)

    def close(self) -> None:
        if self._drainer is not None:
            self._drainer.cancel()
        for fut in [*self._running, *(p[2] for p in self._pending)]:
            fut.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

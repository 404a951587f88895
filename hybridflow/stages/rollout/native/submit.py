"""`TickBatcher`: the trajectory loop's engine traffic, handed over one burst at a time.

    loop thread (asyncio)                               engine thread (frontend.py)
      generate(req) -> asyncio future   --+
      generate(req) ...                   |  buffered while the event loop keeps adding
      drop_sessions(keys)               --+
      an iteration that added nothing: flush --------->  submit_many(requests, drop):
      (or MAX_TICKS iterations after the first)          one inbox entry, one wake-up,
                                                         one admission for the burst

Why: at a turn boundary hundreds of trajectories turn a finished turn into their next
request within a few event-loop iterations. Handed over one by one, the engine thread
wakes at the first and starts an admission (an eager prefill/extend: hundreds of kernel
launches, each of which releases the GIL and must take it back) while this thread still
converts the rest, so every launch waits for the GIL. Measured on an H200
(bench/RESULTS.md, multi-turn): boundary admissions took ~100 ms of host time for ~14 ms
of kernels, 8-11 of them for 3 boundaries. Buffered, a boundary reaches the engine after
the loop has gone quiet and is admitted in as few steps as its prefill budget allows.

The delay is a handful of event-loop iterations (microseconds of the loop's own work),
never a timer: with rows decoding, a request waits for the next decode step anyway.

Invariants: every buffered request reaches the engine (or fails with the engine's
error) in submission order; a burst's drops reach the engine with its requests, in the
inbox entry the engine takes whole before its next admission (the slots they free are
there for them); a cancelled caller's request is not sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence

from hybridflow.stages.deadline import settle_into
from hybridflow.stages.rollout.native.frontend import AsyncEngine
from hybridflow.stages.rollout.native.request import Request, RequestOutput

MAX_TICKS = 8  # a steady stream of arrivals still goes out within this many iterations


class TickBatcher:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._requests: list[tuple[Request, asyncio.Future[RequestOutput]]] = []
        self._drops: list[Hashable] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # set while a flush is armed
        self._added = False  # something arrived since the last tick
        self._ticks = 0
        self.flushes = 0  # hand-overs so far (tests and benchmarks read it)

    def generate(self, request: Request) -> asyncio.Future[RequestOutput]:
        """Queue `request` for the next flush -> the future of its output."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[RequestOutput] = loop.create_future()
        self._requests.append((request, fut))
        self._arm(loop)
        return fut

    def drop_sessions(self, sessions: Sequence[Hashable]) -> None:
        """Free ended sessions' parked K/V at the next flush (at once off the loop)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to flush on: hand it over now
            self.engine.drop_sessions(sessions)
            return
        self._drops.extend(sessions)
        self._arm(loop)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        self._added = True
        if self._loop is None:
            self._loop, self._ticks = loop, 0
            loop.call_soon(self._tick)

    def _tick(self) -> None:
        self._ticks += 1
        if self._added and self._ticks < MAX_TICKS and self._loop is not None:
            self._added = False
            self._loop.call_soon(self._tick)  # this iteration added: wait one more
            return
        self._flush()

    def _flush(self) -> None:
        loop, self._loop = self._loop, None
        batch = [(r, f) for r, f in self._requests if not f.cancelled()]
        drops, self._requests, self._drops = self._drops, [], []
        if not (batch or drops):
            return
        self.flushes += 1
        try:
            futures = self.engine.submit_many([r for r, _ in batch], drops)
        except BaseException as exc:  # closed: every caller gets the engine's error
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        assert loop is not None
        for (_, fut), done in zip(batch, futures, strict=True):
            settle_into(done, fut, loop)

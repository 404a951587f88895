"""`TickBatcher`: the trajectory loop's engine traffic, handed over one burst at a time.

    loop thread (asyncio)                               engine thread (frontend.py)
      generate(req) -> asyncio future   --+
      generate(req) ...                   |  buffered until every session the engine has
      drop_sessions(keys)               --+  answered is back (its next request or its
                                             drop), or nothing arrived for `hold_s`
      flush ----------------------------------------->  submit_many(requests, drop):
                                                         one inbox entry, one wake-up,
                                                         one admission for the burst

Why: at a turn boundary hundreds of trajectories turn a finished turn into their next
request. Handed over one by one, the engine thread wakes at the first and starts an
admission (an eager prefill/extend: hundreds of kernel launches, each of which releases
the GIL and must take it back) while this thread still converts the rest, so every launch
waits for the GIL. Measured on an H200 (bench/RESULTS.md, multi-turn): boundary
admissions took ~100 ms of host time for ~14 ms of kernels, 8-11 of them for 3 boundaries.

When is a burst complete? The batcher knows which sessions are "away": the engine answered
their last request and they have neither sent the next one nor been dropped; they are in
an environment or tool call, or queued for one. A burst goes out when none is away (after
an event-loop iteration that added nothing, so one wake-up's arrivals travel together), or
when nothing has arrived for `hold_s` (or `MAX_HOLDS` x `hold_s` after its first item), so
a slow environment or tool delays the others' next turns by about `hold_s`. The bound is
a quiet gap, not a deadline from the first arrival: a boundary's returns are spread over
the loop's own work on 256 finished turns (~0.1 s on an H200, CPU-bound), and a 20 ms
deadline from the first split every boundary in two (bench/RESULTS.md, session 10). The
first version flushed at the first quiet iteration; that split a boundary into 4-7
admission steps whenever the environments' timers expired over more than one `select`
(bench/RESULTS.md, third sitting). Requests without a session (single-turn) are never
waited for: nothing of theirs comes back.

Invariants: every buffered request reaches the engine (or fails with the engine's
error) in submission order; a burst's drops reach the engine with its requests, in the
inbox entry the engine takes whole before its next admission (the slots they free are
there for them); a cancelled caller's request is not sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from functools import partial

from hybridflow.stages.deadline import settle_into
from hybridflow.stages.rollout.native.frontend import AsyncEngine
from hybridflow.stages.rollout.native.request import Request, RequestOutput

MAX_TICKS = 8  # with no session away, a steady stream still goes out within this many
HOLD_S = 0.02  # the quiet gap after which a burst stops waiting for sessions still away
MAX_HOLDS = 10  # ... and the most it waits in all, in units of hold_s


class TickBatcher:
    def __init__(self, engine: AsyncEngine, hold_s: float = HOLD_S) -> None:
        self.engine = engine
        self.hold_s = hold_s
        self._requests: list[tuple[Request, asyncio.Future[RequestOutput]]] = []
        self._drops: list[Hashable] = []
        self._away: set[Hashable] = set()  # answered sessions not yet back (docstring)
        self._loop: asyncio.AbstractEventLoop | None = None  # set while a flush is armed
        self._timer: asyncio.TimerHandle | None = None  # the burst's hold bound
        self._first = self._last = 0.0  # loop times of the burst's first and last arrival
        self._ticking = False  # a _tick is scheduled
        self._added = False  # something arrived since the last tick
        self._ticks = 0
        self.flushes = 0  # hand-overs so far (tests and benchmarks read it)
        self.held = 0  # flushes that the hold bound sent (sessions still away)

    def generate(self, request: Request) -> asyncio.Future[RequestOutput]:
        """Queue `request` for the next flush -> the future of its output."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[RequestOutput] = loop.create_future()
        self._requests.append((request, fut))
        self._away.discard(request.session)
        self._arm(loop)
        return fut

    def drop_sessions(self, sessions: Sequence[Hashable]) -> None:
        """Free ended sessions' parked K/V at the next flush (at once off the loop)."""
        self._away.difference_update(sessions)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to flush on: hand it over now
            self.engine.drop_sessions(sessions)
            return
        self._drops.extend(sessions)
        self._arm(loop)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        self._added = True
        self._last = loop.time()
        if self._loop is None:
            self._loop, self._ticks, self._first = loop, 0, self._last
            self._timer = loop.call_at(self._last + self.hold_s, self._hold_expired)
        if not self._ticking:  # first arrival, or one that may have brought the last back
            self._ticking = True
            loop.call_soon(self._tick)

    def _tick(self) -> None:
        self._ticking = False
        if self._loop is None:  # flushed by the hold bound meanwhile
            return
        self._ticks += 1
        if self._added and self._ticks < MAX_TICKS:
            self._added = False
            self._ticking = True
            self._loop.call_soon(self._tick)  # this iteration added: wait one more
            return
        if not self._away:
            self._flush()
        # else: idle until an arrival (which ticks again) or the hold bound; no busy loop

    def _hold_expired(self) -> None:
        assert self._loop is not None
        # one timer per burst, moved on lazily: an arrival only records its time
        due = min(self._last + self.hold_s, self._first + MAX_HOLDS * self.hold_s)
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._hold_expired)
            return
        self._timer = None
        self.held += 1
        self._flush()

    def _flush(self) -> None:
        loop, self._loop = self._loop, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
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
        for (request, fut), done in zip(batch, futures, strict=True):
            # answered: its trajectory now prepares its next turn (marked before it resumes)
            away = None if request.session is None else partial(self._away.add, request.session)
            settle_into(done, fut, loop, away)

"""`AsyncEngine`: the native engine behind one dedicated thread, with asyncio futures.

    caller (any thread / event loop)             engine thread "hybridflow-native-engine"
      submit(req) -> Future ---- inbox ---->     add_request; step() while work remains;
      submit_many(reqs, drop)                    (many at once: one wake-up)
      await generate(req) <--- set_result ---    a finished request resolves its future
      call(fn) -> result  ----- inbox ---->      fn(core) between steps, refused while any
                                                 request is in flight (weights, sleep, wake);
                                                 parked sessions are dropped first
      drop_sessions(keys) ----- inbox ---->      free ended trajectories' parked K/V
                                                 (between steps, requests in flight or not)

The thread owns the device: every model, cache and graph operation runs on it, in inbox
order, so callers need no locks. Submissions are only queued (no compute on the caller's
thread or event loop). A step that raises fails every in-flight request with that error
and drops them (the engine stays usable); `close()` fails what is still queued.

Driven (`driver=`, the stage's `StageContext.compute`: the CPU, single-turn): no thread
of its own. A submission from the event loop starts a drive in the stage's worker thread,
which runs the loop above until nothing is left, and later submissions join the running
drive through the inbox. On the CPU a second thread's torch ops run slower once another
thread has used its OpenMP team, and the engine thread made the stage's train and
reference ops ~20% slower (bench/RESULTS.md); driven, every torch op of the process runs in
one thread. `call` then runs in the caller's thread, under the lock drives step under.

Invariants: a request's future resolves exactly once; `call` never runs while a request
is in flight; the thread exits on `close()` (joined, named, never left running).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch

from hybridflow.errors import BatchError
from hybridflow.stages.rollout.native.engine import NativeEngine
from hybridflow.stages.rollout.native.request import Request, RequestOutput

T = TypeVar("T")
log = logging.getLogger("hybridflow.rollout.native")


class EngineClosedError(RuntimeError):
    """The engine was closed before the request finished."""


class AsyncEngine:
    def __init__(
        self,
        core: NativeEngine,
        name: str = "hybridflow-native-engine",
        *,
        gather_s: float = 0.0,
        max_gather_s: float = 0.02,
        driver: Callable[[Callable[[], None]], Awaitable[Any]] | None = None,
    ) -> None:
        """`gather_s` > 0: when nothing is decoding and requests are arriving, wait until
        none has arrived for `gather_s` (at most `max_gather_s` in all) before admitting:
        a multi-turn boundary's next turns arrive one by one as the trajectory loop turns
        each finished turn into a request, and admitting them as they come costs an
        admission step (a prefill forward and its host work) per handful, run while that
        loop's thread holds the GIL. Never waits while rows are decoding."""
        self.core = core
        self.gather_s, self.max_gather_s = gather_s, max_gather_s
        self._cv = threading.Condition()
        self._inbox: deque[tuple[str, Any, cf.Future[Any]]] = deque()
        self._futures: dict[int, cf.Future[RequestOutput]] = {}
        self._closing = False
        self._driver, self._driving = driver, False
        self._drives: set[asyncio.Future[Any]] = set()
        self._lock = threading.Lock()  # driven: a drive's steps and `call` never overlap
        self._thread: threading.Thread | None = None
        if driver is None:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    # -- caller side ---------------------------------------------------------------------
    def submit(self, request: Request) -> cf.Future[RequestOutput]:
        return self._put("request", request)

    async def generate(self, request: Request) -> RequestOutput:
        return await asyncio.wrap_future(self.submit(request))

    def submit_many(
        self, requests: Sequence[Request], drop: Sequence[Hashable] = ()
    ) -> list[cf.Future[RequestOutput]]:
        """Drop the sessions `drop`, then queue `requests`, as one inbox hand-over: the
        engine thread wakes once and sees them all (submit.TickBatcher says why)."""
        futures: list[cf.Future[Any]] = [cf.Future() for _ in requests]
        with self._cv:
            if self._closing:
                raise EngineClosedError("native engine is closed")
            if drop:
                self._inbox.append(("drop", list(drop), cf.Future()))
            self._inbox.extend(("request", r, f) for r, f in zip(requests, futures, strict=True))
            self._cv.notify()
        return futures

    def drop_sessions(self, sessions: Sequence[Hashable]) -> cf.Future[None]:
        """Free the parked K/V of ended sessions (no need to wait for it)."""
        return self._put("drop", list(sessions))

    def call(self, fn: Callable[[NativeEngine], T]) -> T:
        """Run `fn(core)` on the engine thread between steps; BatchError if requests are
        in flight (the runtime reshards and sleeps between phases, never during one)."""
        if self._driver is None:
            return self._put("call", fn).result()
        fut: cf.Future[T] = cf.Future()
        with self._lock:
            self._call(fn, fut)
        return fut.result()

    def in_flight(self) -> int:
        with self._cv:
            return len(self._futures) + sum(kind == "request" for kind, _, _ in self._inbox)

    def close(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
            idle = not self._driving
        if self._thread is None:  # driven: a running drive shuts down at its next turn
            if idle:
                with self._lock:
                    self._shutdown()
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("native engine thread did not stop within %.0f s", timeout)

    def _put(self, kind: str, item: Any) -> cf.Future[Any]:
        fut: cf.Future[Any] = cf.Future()
        with self._cv:
            if self._closing:
                raise EngineClosedError("native engine is closed")
            self._inbox.append((kind, item, fut))
            self._cv.notify()
            kick = self._driver is not None and not self._driving
            self._driving = self._driving or kick
        if kick:
            self._start_drive()
        return fut

    # -- driven: the loop in the stage's worker thread ---------------------------------
    def _start_drive(self) -> None:
        assert self._driver is not None
        try:
            task = asyncio.ensure_future(self._driver(self._drive))
        except RuntimeError:  # no running event loop here: driven callers submit from one
            with self._cv:
                self._driving = False
            raise
        self._drives.add(task)
        task.add_done_callback(self._drives.discard)

    def _drive(self) -> None:
        """Take the inbox and step until nothing is left (or the engine closes)."""
        stop = False  # fail what is left: closing, or a bug in the loop itself
        try:
            while True:
                with self._cv:
                    if self._closing or not (self._inbox or self.core.has_work()):
                        self._driving, stop = False, self._closing
                        return
                    inbox = list(self._inbox)
                    self._inbox.clear()
                with self._lock:
                    self._take(inbox)
                    if self.core.has_work():
                        self._step()
        except BaseException:
            stop = True
            with self._cv:
                self._driving = False
            raise
        finally:
            if stop:
                with self._lock:
                    self._shutdown()

    # -- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        if self.core.device.type == "cuda":
            torch.cuda.set_device(self.core.device)
        while True:
            with self._cv:
                while not (self._inbox or self._closing or self.core.has_work()):
                    self._cv.wait()
                if self._closing:
                    break
                inbox = list(self._inbox)
                self._inbox.clear()
            self._take(inbox)
            if self.gather_s > 0 and not self.core.scheduler.active and inbox:
                self._gather()
            if self.core.has_work():
                self._step()
        self._shutdown()

    def _take(self, inbox: list[tuple[str, Any, cf.Future[Any]]]) -> None:
        for kind, item, fut in inbox:
            if kind == "request":
                self._add(item, fut)
            elif kind == "drop":
                self._drop(item, fut)
            else:
                self._call(item, fut)

    def _gather(self) -> None:
        """Take in arriving requests until a quiet `gather_s` (see __init__)."""
        end = time.monotonic() + self.max_gather_s
        while (left := end - time.monotonic()) > 0:
            with self._cv:
                if not (self._inbox or self._closing):
                    self._cv.wait(min(self.gather_s, left))
                if self._closing or not self._inbox:
                    return
                inbox = list(self._inbox)
                self._inbox.clear()
            self._take(inbox)

    def _add(self, request: Request, fut: cf.Future[Any]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            rid = self.core.add_request(request)
        except BaseException as exc:
            fut.set_exception(exc)
            return
        self._futures[rid] = fut

    def _drop(self, sessions: list[Hashable], fut: cf.Future[Any]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            self.core.drop_sessions(sessions)
            fut.set_result(None)
        except BaseException as exc:
            fut.set_exception(exc)

    def _call(self, fn: Callable[[NativeEngine], Any], fut: cf.Future[Any]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            if self.core.in_flight():
                raise BatchError(
                    f"native engine: {self.core.in_flight()} request(s) in flight; weight "
                    "updates, sleep and wake-up run between rollout phases only"
                )
            # Parked K/V was computed by the weights `fn` may be about to change.
            self.core.drop_all_sessions()
            fut.set_result(fn(self.core))
        except BaseException as exc:
            fut.set_exception(exc)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.core.step()
            self.core.stats["busy_s"] += time.perf_counter() - t0
        except BaseException as exc:
            log.exception("native engine step failed; failing %d request(s)", len(self._futures))
            self.core.abort_all()
            futures, self._futures = self._futures, {}
            for fut in futures.values():
                fut.set_exception(exc)
            return
        for out in outputs:
            fut = self._futures.pop(out.request_id)
            if not fut.cancelled():
                fut.set_result(out)

    def _shutdown(self) -> None:
        self.core.abort_all()
        closed = EngineClosedError("native engine closed before the request finished")
        with self._cv:
            pending = [fut for _, _, fut in self._inbox]
            self._inbox.clear()
        for fut in [*self._futures.values(), *pending]:
            if not fut.done():
                fut.set_exception(closed)
        self._futures.clear()

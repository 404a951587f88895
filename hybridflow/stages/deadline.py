"""Sync calls with a deadline: run on reused daemon threads, abandoned at the deadline, capped.

Shared by the per-sample reward caller (stages/reward/per_sample.py: one concurrent
Future per verifier call) and the environment protocol (stages/env/protocol.py: one
asyncio Future per reset/step/tool call). Both need the same three things:

    calls = DaemonCalls(max_stuck=32, what="reward gsm8k", setting="options.timeout_s")
    fut = calls.start(fn, *args, name="reward-fn-3", **kwargs)  # concurrent.futures.Future
    ... at its deadline, the caller gives up:  calls.abandon(fut)
    calls.check()   # before each start: raises TooManyStuck past max_stuck

Why daemon threads: the callee is plain Python (a regex verifier, a game's step, a tool)
that may spin on a pathological input, and a thread cannot be killed. A call past its
deadline is abandoned: the caller gets its timeout at once and the thread runs on as a
daemon, so it can never block the process's exit. Each abandoned call still holds a
thread (and whatever it holds); `max_stuck` bounds how many may still be running at once.
Past it the callee hangs on these inputs rather than being slow, and `check` raises
`TooManyStuck`, which callers translate into their own error family (the message names
the call, the count and the setting whose raise would let slow calls finish).

Invariants: `start` never blocks; a Future from `start` is settled exactly once, by its
thread; `stuck` counts abandoned calls whose thread has not returned yet (finished ones
are forgotten on each `check`). Thread-safe: calls may start from several threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["DaemonCalls", "TooManyStuck", "as_asyncio", "settle_into", "start_daemon"]


class TooManyStuck(RuntimeError):
    """More abandoned calls are still running than `max_stuck` allows."""

    def __init__(self, message: str, *, what: str, stuck: int, max_stuck: int) -> None:
        self.what, self.stuck, self.max_stuck = what, stuck, max_stuck
        super().__init__(message)


def start_daemon(fn: Callable[..., Any], *args: Any, name: str, **kwargs: Any) -> Future[Any]:
    """`fn(*args, **kwargs)` on a daemon thread named `name` while it runs; its Future.
    The thread is a reused worker of the process's pool (`_Workers`)."""
    fut: Future[Any] = Future()
    _WORKERS.submit(fut, fn, args, kwargs, name)
    return fut


class _Workers:
    """Reused daemon threads: a call takes an idle worker, or a new one when none is idle
    (never queued behind a busy one, so calls run as concurrently as they are started,
    which is what `env_concurrency` and a reward's `max_workers` promise). Why: a thread
    start cost ~0.7-1.5 ms on the CPU machine (measured: a multi-turn call of 256
    trajectories spent ~0.4 s starting one thread per synchronous `reset`), and a
    rollout makes such calls for every row of every step. A worker idle for `IDLE_S`
    exits. An abandoned call keeps its worker until it returns (it is a daemon: it never
    blocks the process's exit); the others go on without it.

    Accounting (under the lock): `idle` = workers waiting for a job minus jobs handed to
    them and not taken yet; a submit takes one (idle -= 1) or starts a worker."""

    IDLE_S = 60.0

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._count = itertools.count()

    def submit(
        self, fut: Future[Any], fn: Callable[..., Any], args: Any, kwargs: Any, name: str
    ) -> None:
        self._jobs.put((fut, fn, args, kwargs, name))
        with self._lock:
            if self._idle > 0:
                self._idle -= 1
                return
        worker = f"hybridflow-worker-{next(self._count)}"
        threading.Thread(target=self._work, name=worker, daemon=True).start()

    def _work(self) -> None:
        me = threading.current_thread()
        own = me.name
        while True:
            try:
                fut, fn, args, kwargs, name = self._jobs.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # idle and not handed a job: leave
                        self._idle -= 1
                        return
                continue  # a job was handed to this worker as the wait ended
            me.name = name
            result: Any = None
            error: BaseException | None = None
            running = fut.set_running_or_notify_cancel()
            if running:
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # handed to the waiter, as a pool thread does
                    error = exc
            me.name = own
            # Idle before the caller hears back: its next call finds this worker
            with self._lock:
                self._idle += 1
            if running:
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(result)
            del fut, fn, args, kwargs, result, error  # hold nothing while idle


_WORKERS = _Workers()


def as_asyncio(fut: Future[Any]) -> asyncio.Future[Any]:
    """An asyncio Future on the running loop that settles with `fut`. Cancelling it (as
    `asyncio.wait_for` does at a deadline) leaves the thread running; a thread that
    returns after the loop closed settles nothing (nobody waits any more)."""
    loop = asyncio.get_running_loop()
    out: asyncio.Future[Any] = loop.create_future()
    settle_into(fut, out, loop)
    return out


def settle_into(
    src: Future[Any],
    out: asyncio.Future[Any],
    loop: asyncio.AbstractEventLoop,
    on_result: Callable[[], None] | None = None,
) -> None:
    """When `src` (settled on any thread) is done, copy its outcome into `out` on `loop`,
    unless `out` is done by then (cancelled, abandoned); a closed loop gets nothing.
    `on_result` runs on `loop` just before a result (not an error) is set, so it happens
    before anything that awaits `out` resumes."""

    def settle(done: Future[Any]) -> None:
        if out.done():
            return
        exc = done.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            if on_result is not None:
                on_result()
            out.set_result(done.result())

    def wake(done: Future[Any]) -> None:
        # RuntimeError: the loop closed while the call ran
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, done)

    src.add_done_callback(wake)


class DaemonCalls:
    """Daemon-thread calls of one callee, and the count of abandoned ones (module doc)."""

    def __init__(self, *, max_stuck: int, what: str, setting: str) -> None:
        if max_stuck < 1:
            raise ValueError(f"{what}: max_stuck must be >= 1, got {max_stuck}")
        self.max_stuck, self.what, self.setting = max_stuck, what, setting
        self._lock = threading.Lock()
        self._stuck: list[Future[Any]] = []  # abandoned calls that may still be running

    @property
    def stuck(self) -> int:
        with self._lock:
            self._stuck = [f for f in self._stuck if not f.done()]
            return len(self._stuck)

    def check(self) -> None:
        """Raise TooManyStuck when `max_stuck` abandoned calls are still running."""
        n = self.stuck
        if n >= self.max_stuck:
            raise TooManyStuck(
                f"{self.what}: {n} calls timed out and are still running (max_stuck "
                f"{self.max_stuck}); it hangs on these inputs rather than being slow: fix "
                f"it or raise {self.setting}",
                what=self.what,
                stuck=n,
                max_stuck=self.max_stuck,
            )

    def start(self, fn: Callable[..., Any], *args: Any, name: str, **kwargs: Any) -> Future[Any]:
        """`check`, then `fn(*args, **kwargs)` in a daemon thread named `name`."""
        self.check()
        return start_daemon(fn, *args, name=name, **kwargs)

    def abandon(self, fut: Future[Any]) -> None:
        """The caller gave up on `fut` at its deadline; it counts until its thread returns."""
        if not fut.done():
            with self._lock:
                self._stuck.append(fut)

"""`DaemonExecutor`: one named daemon thread running submitted calls in order (FIFO).

Why not `ThreadPoolExecutor(1)`: the interpreter joins pool threads at exit, so a
coordinator whose compute thread is inside a long driver op (or whose io thread builds a
huge batch) cannot exit on Ctrl-C/SIGTERM until that call returns, which may be never.
A daemon thread is abandoned at exit instead: the run's teardown (Shutdown to the stages,
launcher.stop, shm sweep) runs on the main thread and the process leaves within seconds.

Invariant: calls run one at a time in submission order on the thread named `name` (the
coordinator relies on it: driver ops never overlap, sinks write steps in order); after
`shutdown()` nothing new starts, and `cancel_futures=True` cancels what has not started.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonExecutor(Executor):
    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"executor {self.name} is shut down")
            self._queue.put((fut, fn, args, kwargs))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
        return fut

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the waiter, as a pool thread does
                fut.set_exception(exc)
            else:
                fut.set_result(result)
            del item, fut, fn, args, kwargs  # drop references while waiting

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                if cancel_futures:
                    while True:
                        try:
                            item = self._queue.get_nowait()
                        except queue.Empty:
                            break
                        if item is not None:
                            item[0].cancel()
                self._queue.put(None)
            thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

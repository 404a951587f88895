"""Per-sample reward calls: verl's `compute_score` signature, run concurrently and bounded.

verl's reward functions (and hybridflow.reward.scorers) score one sample per call:

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

`is_per_sample(fn)` tells that signature from the function backend's batched one by its
parameter names. `PerSampleCaller.run(calls)` makes one call per sample, by keyword as
verl does (so `extra_info` may be left out of a function's parameters), with at most
`max_workers` calls in flight and a deadline of `timeout_s` each, and returns one
`Outcome` per call, in order.

Why threads, and daemon ones: a verifier is plain Python (regexes, sympy) that may spin
on a pathological input, and a thread cannot be killed. A call past its deadline is
abandoned: its outcome is a timeout, its slot is freed for the next call, and the thread
runs on as a daemon (it can never block the stage process's exit). `max_stuck` bounds
how many abandoned calls may still be running; past it the function is broken, not slow,
and `run` raises. The threads and that count are stages/deadline.py's `DaemonCalls`,
which the environment protocol shares. `async def` functions are awaited on a private
event loop, each under `asyncio.wait_for` (cancelled at its deadline), with the same
bound on concurrency.

Invariant: `run` returns one Outcome per call whatever each call did; only a broken
function (too many stuck calls) raises, as RewardFunctionError.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from hybridflow.errors import RewardFunctionError
from hybridflow.reward.values import BadReward, split_result
from hybridflow.stages.deadline import DaemonCalls, TooManyStuck
from hybridflow.transport import aio

VERL_PARAMS = ("data_source", "solution_str", "ground_truth")


def is_per_sample(fn: Callable[..., Any]) -> bool:
    """Whether `fn` takes verl's per-sample arguments (by name: data_source,
    solution_str, ground_truth); else it is the batched signature."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the batched default
        return False
    return all(name in params for name in VERL_PARAMS)


def takes_extra_info(fn: Callable[..., Any]) -> bool:
    params = inspect.signature(fn).parameters
    return "extra_info" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )


@dataclass
class Outcome:
    """One call's result: `score` and `extras` when it succeeded, else `error` (the
    cause, one line) and whether it was a timeout."""

    score: float | None = None
    extras: dict[str, float | str] = field(default_factory=dict)
    error: str = ""
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.score is not None


class PerSampleCaller:
    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        *,
        timeout_s: float,
        max_workers: int,
        max_stuck: int | None = None,
    ) -> None:
        self.fn, self.name = fn, name
        self.timeout_s, self.max_workers = timeout_s, max_workers
        self.max_stuck = max_stuck if max_stuck is not None else 4 * max_workers
        self.is_async = inspect.iscoroutinefunction(fn)
        self.extra_info = takes_extra_info(fn)
        self._calls = DaemonCalls(
            max_stuck=self.max_stuck, what=f"reward function {name}", setting="options.timeout_s"
        )

    def run(self, calls: Sequence[dict[str, Any]]) -> list[Outcome]:
        """One Outcome per call (kwargs: data_source, solution_str, ground_truth,
        extra_info), in order."""
        if not self.extra_info:
            calls = [{k: v for k, v in c.items() if k != "extra_info"} for c in calls]
        if self.is_async:
            return aio.run(self._run_async(calls))
        return self._run_threads(calls)

    # -- sync functions: daemon threads ---------------------------------------------------
    def _run_threads(self, calls: Sequence[dict[str, Any]]) -> list[Outcome]:
        out: list[Outcome | None] = [None] * len(calls)
        running: dict[Future[Any], tuple[int, float]] = {}  # -> (call index, deadline)
        todo = iter(range(len(calls)))
        exhausted = False
        while True:
            while not exhausted and len(running) < self.max_workers:
                i = next(todo, None)
                if i is None:
                    exhausted = True
                    break
                try:
                    fut = self._calls.start(self.fn, name=f"reward-fn-{i}", **calls[i])
                except TooManyStuck as exc:
                    raise RewardFunctionError(str(exc), function=self.name) from None
                running[fut] = (i, time.monotonic() + self.timeout_s)
            if not running:
                break
            first_deadline = min(d for _, d in running.values())
            done, _ = wait(
                list(running),
                timeout=max(0.0, first_deadline - time.monotonic()),
                return_when=FIRST_COMPLETED,
            )
            now = time.monotonic()
            for fut in list(running):
                i, deadline = running[fut]
                if fut in done:
                    out[i] = _outcome(fut, i)
                elif now >= deadline:
                    out[i] = Outcome(error=f"timed out after {self.timeout_s:g}s", timed_out=True)
                    self._calls.abandon(fut)
                else:
                    continue
                del running[fut]
        return [o if o is not None else Outcome(error="not run") for o in out]

    # -- async functions: one private loop ------------------------------------------------
    async def _run_async(self, calls: Sequence[dict[str, Any]]) -> list[Outcome]:
        gate = asyncio.Semaphore(self.max_workers)

        async def one(i: int) -> Outcome:
            async with gate:
                try:
                    value = await asyncio.wait_for(self.fn(**calls[i]), self.timeout_s)
                except TimeoutError:
                    return Outcome(error=f"timed out after {self.timeout_s:g}s", timed_out=True)
                except (Exception, GeneratorExit) as exc:  # the function's own: one outcome
                    return Outcome(error=f"{type(exc).__name__}: {exc}")
                return _checked(value, i)

        return list(await asyncio.gather(*(one(i) for i in range(len(calls)))))


def _outcome(fut: Future[Any], index: int) -> Outcome:
    exc = fut.exception()
    if exc is not None:
        return Outcome(error=f"{type(exc).__name__}: {exc}")
    return _checked(fut.result(), index)


def _checked(value: Any, index: int) -> Outcome:
    try:
        score, extras = split_result(value, index)
    except BadReward as exc:
        return Outcome(error=f"returned {exc}")
    return Outcome(score=score, extras=extras)

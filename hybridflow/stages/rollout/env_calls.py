"""How the trajectory loop (multiturn.py) calls its environments: every call bounded by
`env_timeout_s` and named by row and turn, calls run side by side under a concurrency
bound, and every environment closed at the end, failure or not.

Errors keep their class: an EnvError (a timeout, a remote service's EnvServiceError with
its url and session, a stuck-thread EnvStuckError) gets the row and turn prepended to
its message and is raised as itself; an environment's own exception becomes an EnvError
naming the call, with the original as its cause (protocol.env_call's rule).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from hybridflow.stages.env.protocol import EnvError, Environment, call, close_env

T = TypeVar("T")
SETTING = "env_timeout_s"  # the option that bounds every call (named in timeouts)


async def env_call(
    method: Callable[..., Any], *args: Any, timeout_s: float, row: int, turn: int
) -> Any:
    """`method(*args)` (sync or async) within `timeout_s`; turn -1 is the reset."""
    owner = getattr(method, "__self__", None)
    what = f"{type(owner).__name__}.{getattr(method, '__name__', 'call')}"
    where = f"multi-turn row {row}" + (f" turn {turn}" if turn >= 0 else "")
    try:
        return await call(method, *args, timeout_s=timeout_s, what=what, setting=SETTING)
    except EnvError as exc:  # as itself, with where it happened
        exc.args = (f"{where}: {exc}", *exc.args[1:])
        exc.what = exc.what or what
        raise
    except Exception as exc:  # the environment's own bug: named, the micro-batch stops
        raise EnvError(f"{where}: {what} raised {type(exc).__name__}: {exc}", what=what) from exc


async def bounded(coros: list[Coroutine[Any, Any, T]], limit: int) -> list[T]:
    """Run `coros` at most `limit` at a time; results in order. The first failure
    cancels the rest (TaskGroup) and propagates as itself (not as a group)."""
    sem = asyncio.Semaphore(max(1, limit))

    async def one(coro: Coroutine[Any, Any, T]) -> T:
        async with sem:
            return await coro

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(c)) for c in coros]
    except BaseExceptionGroup as group:
        first = next(
            (e for e in group.exceptions if not isinstance(e, asyncio.CancelledError)),
            group.exceptions[0],
        )
        raise first from first.__cause__  # its own cause kept, the group dropped
    return [t.result() for t in tasks]


async def close_all(envs: list[Environment], timeout_s: float, *, report: bool = True) -> None:
    """Close every environment built (also after a failure); with `report`, a close that
    failed is raised once, after all were tried."""
    if not envs:
        return
    results = await asyncio.gather(
        *(close_env(env, timeout_s=timeout_s) for env in envs), return_exceptions=True
    )
    failed = [r for r in results if isinstance(r, Exception)]
    if failed and report:
        raise EnvError(
            f"multi-turn: {len(failed)} environment close call(s) failed, first: "
            f"{type(failed[0]).__name__}: {failed[0]}",
            what="close",
        ) from failed[0]

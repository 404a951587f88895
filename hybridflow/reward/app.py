"""The protocol-independent core of a reward server: request bytes in, reply bytes out.

Wraps a user's reward function and is shared by the HTTP and ZeroMQ front ends
(http_server.py, zmq_server.py), which only move bytes and map `RequestRejected` to a
status code. The fronts ask a core for nothing but `ServiceCore` (below), so other
services (the environment service, hybridflow/stages/env/service/) reuse them as they are.

The reward function's signature (the same one the in-process `function` reward backend
calls, so one function serves both ways):

    def fn(prompts: list[str], responses: list[str], prompt_ids: list[list[int]],
           response_ids: list[list[int]], metadata: list[dict]) -> list[float]

It may be `async def`. It is called with `prompts` and `responses` positionally and the
rest by keyword, so it may also declare those keyword-only. Sync functions run in a
thread pool of `concurrency` threads (the event loop keeps answering health checks);
pass `concurrency=1` for a function that is not thread-safe.

Invariants:
  - the function sees at most `max_batch` items per call, and is called at most once per
    `request_id`: a retry of a request that is running or done (kept for the last
    `cache_size` requests) gets the same reply; a failed call is not cached, so a retry
    after a 500 runs again;
  - a reply always has one finite float per item; a function that returns anything else
    is answered with 500 naming the function (never padded, never zero-filled).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from hybridflow.reward.schema import (
    PROTOCOL_VERSION,
    Encoding,
    ErrorReply,
    Health,
    RequestRejected,
    Reward,
    ScoreReply,
    ScoreRequest,
    decode_request,
    encode,
)
from hybridflow.reward.values import BadReward, reward_list

log = logging.getLogger("hybridflow.reward.server")

RewardFn = Callable[..., object]


class ServiceCore(Protocol):
    """What the HTTP and ZeroMQ front ends need of a service: `handle` turns one request
    body into one reply body (raising RequestRejected for a non-200 answer), `health`
    answers a health check, and `name` / `max_body_bytes` are for logs and limits."""

    name: str
    max_body_bytes: int

    def health(self, encoding: Encoding) -> bytes: ...

    async def handle(self, body: bytes, encoding: Encoding) -> bytes: ...

    async def aclose(self) -> None: ...


def function_name(fn: RewardFn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


class RewardApp:
    def __init__(
        self,
        fn: RewardFn,
        *,
        max_batch: int,
        max_body_bytes: int,
        concurrency: int = 8,
        cache_size: int = 1024,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"reward function must be callable, got {fn!r}")
        if max_batch < 1 or concurrency < 1:
            raise ValueError("max_batch and concurrency must be >= 1")
        self.fn = fn
        self.name = function_name(fn)
        self.max_batch = max_batch
        self.max_body_bytes = max_body_bytes
        self._is_async = inspect.iscoroutinefunction(fn)
        self._sem = asyncio.Semaphore(concurrency)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=concurrency, thread_name_prefix="reward-fn"
        )
        # request_id -> (item ids, task computing the reply); LRU over the last cache_size
        self._cache: OrderedDict[str, tuple[tuple[str, ...], asyncio.Future]] = OrderedDict()
        self._cache_size = cache_size
        self.calls = 0  # function invocations (tests and logs)

    def health(self, encoding: Encoding) -> bytes:
        return encode(Health(max_batch=self.max_batch), encoding)

    @staticmethod
    def error(status: int, message: str, encoding: Encoding, request_id: str | None = None):
        return encode(ErrorReply(error=message, request_id=request_id), encoding)

    async def handle(self, body: bytes, encoding: Encoding) -> bytes:
        """ServiceCore: a request body is a ScoreRequest."""
        return await self.score(body, encoding)

    async def score(self, body: bytes, encoding: Encoding) -> bytes:
        """Decode, deduplicate, score, encode. Raises RequestRejected(4xx/5xx)."""
        req = decode_request(
            body, encoding, max_body_bytes=self.max_body_bytes, max_batch=self.max_batch
        )
        ids = tuple(item.id for item in req.items)
        if not req.request_id:
            return encode(await self._score(req), encoding)
        hit = self._cache.get(req.request_id)
        if hit is not None:
            if hit[0] != ids:
                raise RequestRejected(
                    409, f"request_id {req.request_id!r} was already used for other item ids"
                )
            self._cache.move_to_end(req.request_id)
            fut = hit[1]
        else:
            fut = asyncio.ensure_future(self._score(req))
            self._cache[req.request_id] = (ids, fut)
            fut.add_done_callback(functools.partial(self._forget_failure, req.request_id))
            self._evict()
        # shield: a client that hangs up must not cancel the work a retry will ask for
        return encode(await asyncio.shield(fut), encoding)

    def _forget_failure(self, request_id: str, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            entry = self._cache.get(request_id)
            if entry is not None and entry[1] is fut:
                del self._cache[request_id]

    def _evict(self) -> None:
        while len(self._cache) > self._cache_size:
            oldest = next(iter(self._cache))
            if not self._cache[oldest][1].done():
                break  # never drop running work; the cache may briefly exceed its size
            del self._cache[oldest]

    async def _score(self, req: ScoreRequest) -> ScoreReply:
        items = req.items
        args = (
            [i.prompt for i in items],
            [i.response for i in items],
        )
        kwargs = {
            "prompt_ids": [i.prompt_ids for i in items],
            "response_ids": [i.response_ids for i in items],
            "metadata": [dict(i.metadata) for i in items],
        }
        async with self._sem:
            self.calls += 1
            try:
                if self._is_async:
                    out = await self.fn(*args, **kwargs)
                else:
                    loop = asyncio.get_running_loop()
                    call = functools.partial(self.fn, *args, **kwargs)
                    out = await loop.run_in_executor(self._pool, call)
                    if inspect.isawaitable(out):
                        out = await out
            except Exception as exc:  # the user's function: report it, keep serving
                log.exception("reward function %s raised on request %s", self.name, req.request_id)
                raise RequestRejected(
                    500, f"reward function {self.name} raised {type(exc).__name__}: {exc}"
                ) from exc
        rewards = self._check(out, len(items))
        return ScoreReply(
            version=PROTOCOL_VERSION,
            request_id=req.request_id,
            rewards=[Reward(id=i.id, reward=r) for i, r in zip(items, rewards, strict=True)],
        )

    def _check(self, out: object, n: int) -> list[float]:
        """The one value check (hybridflow/reward/values.py): n finite float32 numbers;
        a dict, a string or 1e39 is a 500 naming the function, never a reward."""
        try:
            return reward_list(out, n)
        except BadReward as exc:
            what = exc.why if exc.index < 0 else f"{exc.value} at index {exc.index}; {exc.why}"
            raise RequestRejected(500, f"reward function {self.name} returned {what}") from None

    async def aclose(self) -> None:
        pending = [entry[1] for entry in self._cache.values() if not entry[1].done()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

"""The reward server SDK: turn a Python reward function into a conforming service.

    from hybridflow.reward import serve
    serve(my_reward, protocol="http", port=8000)        # blocks; Ctrl-C / SIGTERM stops it

    hybridflow reward-serve mypkg.rewards:my_reward --protocol zmq --port 5555

A client has `body_timeout_s` (default 30 s) to send a request's whole body over HTTP;
one that stalls gets 408 and is disconnected, so half-sent requests cannot hold the
server's connections (ZeroMQ delivers whole messages only, so it has nothing to time out).
`hybridflow reward-serve` takes it from $HYBRIDFLOW_REWARD_BODY_TIMEOUT_S.

`serve` blocks until SIGINT/SIGTERM, then stops accepting, lets running requests finish
(up to `grace_s`) and returns. `start_server` is the same without blocking, for
embedding in an existing event loop (and for tests): it returns a `RunningServer` with
the bound `address` (pass port=0 for a free port) and `aclose()`. `start_front` and
`serve_until_stopped` are those two for any `ServiceCore` (app.py): the environment
service (hybridflow/stages/env/service/) is served by them too.

The function contract is in app.py. It binds 127.0.0.1 unless `host` says otherwise:
the protocol has no encryption, and the bearer token (HTTP) only keeps honest
neighbours out.

`cli_serve` loads `package.module:function` with importlib (never eval) and prints one
line `hybridflow reward-serve: listening on <address>` on stdout when it is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Literal

from hybridflow.errors import ConfigError
from hybridflow.reward.app import RewardApp, RewardFn, ServiceCore
from hybridflow.reward.schema import DEFAULT_MAX_BODY_BYTES, ZMQ_SCORE
from hybridflow.transport import aio

log = logging.getLogger("hybridflow.reward.server")

Protocol = Literal["http", "zmq"]
TOKEN_ENV = "HYBRIDFLOW_REWARD_TOKEN"  # the CLI reads the server's bearer token from here
BODY_TIMEOUT_ENV = "HYBRIDFLOW_REWARD_BODY_TIMEOUT_S"  # ... and its body timeout
DEFAULT_BODY_TIMEOUT_S = 30.0  # a 32 MiB body at ~1 MB/s; loopback and LANs take far less


class RunningServer:
    """A started server: `address` is what clients connect to."""

    def __init__(self, core: ServiceCore, front) -> None:
        self.core, self._front = core, front

    @property
    def address(self) -> str:
        return self._front.address

    @property
    def port(self) -> int:
        return self._front.port

    async def aclose(self) -> None:
        try:
            await self._front.aclose()
        finally:
            await self.core.aclose()

    async def __aenter__(self) -> RunningServer:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


async def start_front(
    core: ServiceCore,
    protocol: Protocol,
    host: str,
    port: int,
    *,
    token: str | None = None,
    grace_s: float = 10.0,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    http_paths: tuple[str, ...] = ("/", "/score"),
    http_path: str = "/score",
    zmq_method: bytes = ZMQ_SCORE,
) -> RunningServer:
    """Serve any `ServiceCore` over HTTP (POST on `http_paths`; `http_path` is the one
    its address names) or ZeroMQ (requests whose method frame is `zmq_method`); both
    answer health checks. The reward server and the environment service both start here."""
    if protocol == "http":
        from hybridflow.reward.http_server import HttpServer

        front = HttpServer(
            core, host, port, token, grace_s, body_timeout_s, paths=http_paths, path=http_path
        )
    elif protocol == "zmq":
        if token is not None:
            raise ValueError("token applies to protocol='http' only")
        from hybridflow.reward.zmq_server import ZmqServer

        front = ZmqServer(core, host, port, grace_s, method=zmq_method)
    else:
        raise ValueError(f"protocol must be 'http' or 'zmq', got {protocol!r}")
    await front.start()
    return RunningServer(core, front)


async def start_server(
    fn: RewardFn,
    protocol: Protocol = "http",
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    max_batch: int = 256,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    concurrency: int = 8,
    token: str | None = None,
    grace_s: float = 10.0,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> RunningServer:
    core = RewardApp(
        fn, max_batch=max_batch, max_body_bytes=max_body_bytes, concurrency=concurrency
    )
    return await start_front(
        core,
        protocol,
        host,
        port,
        token=token,
        grace_s=grace_s,
        body_timeout_s=body_timeout_s,
    )


def serve_until_stopped(
    start: Callable[[], Awaitable[RunningServer]],
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Run `start()` on a fresh event loop and serve until SIGINT/SIGTERM (signals are
    only caught on the main thread; from another thread, cancel the loop instead), then
    close the server. `on_ready(address)` runs once bound."""

    async def main() -> None:
        server = await start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        caught = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
                caught.append(sig)
        log.info("serving %s on %s", server.core.name, server.address)
        if on_ready is not None:
            on_ready(server.address)
        try:
            await stop.wait()
            log.info("shutting down %s", server.address)
        finally:
            for sig in caught:
                loop.remove_signal_handler(sig)
            await server.aclose()

    aio.run(main())


def serve(
    fn: RewardFn,
    protocol: Protocol = "http",
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    max_batch: int = 256,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    concurrency: int = 8,
    token: str | None = None,
    grace_s: float = 10.0,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve `fn` until SIGINT/SIGTERM (serve_until_stopped). `on_ready(address)` runs
    once bound."""

    def start() -> Awaitable[RunningServer]:
        return start_server(
            fn,
            protocol,
            host,
            port,
            max_batch=max_batch,
            max_body_bytes=max_body_bytes,
            concurrency=concurrency,
            token=token,
            grace_s=grace_s,
            body_timeout_s=body_timeout_s,
        )

    serve_until_stopped(start, on_ready)


def load_function(target: str) -> RewardFn:
    """`package.module:function` (attribute path may be dotted) -> the callable."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError("function", f"expected package.module:function, got {target!r}")
    # Like `python -m`, resolve modules relative to the working directory as well, so
    # `hybridflow reward-serve rewards:fn` finds ./rewards.py from the console script.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("function", f"cannot import module {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError("function", f"{target!r}: no attribute {part!r}") from None
    if not callable(obj):
        raise ConfigError("function", f"{target!r} is a {type(obj).__name__}, not callable")
    return obj


def cli_serve(args: argparse.Namespace) -> int:
    """`hybridflow reward-serve package.module:function [--protocol] [--host] [--port]
    [--max-batch]`; the HTTP bearer token, if any, comes from $HYBRIDFLOW_REWARD_TOKEN."""
    fn = load_function(args.function)
    if args.max_batch < 1:
        raise ConfigError("--max-batch", f"must be >= 1, got {args.max_batch}")
    token = os.environ.get(TOKEN_ENV) or None
    body_timeout_s = _body_timeout(args)
    if args.protocol == "http":
        if args.host not in ("127.0.0.1", "localhost", "::1") and token is None:
            log.warning("serving on %s without a bearer token (set %s)", args.host, TOKEN_ENV)
    else:
        token = None  # ZeroMQ has no token; it relies on binding to loopback

    def ready(address: str) -> None:
        print(f"hybridflow reward-serve: listening on {address}", flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        serve(
            fn,
            args.protocol,
            args.host,
            args.port,
            max_batch=args.max_batch,
            concurrency=getattr(args, "concurrency", 8),
            token=token,
            body_timeout_s=body_timeout_s,
            on_ready=ready,
        )
    return 0


def _body_timeout(args: argparse.Namespace) -> float:
    """`args.body_timeout_s` where the parser has it, else $HYBRIDFLOW_REWARD_BODY_TIMEOUT_S,
    else the default; a positive number of seconds."""
    given = getattr(args, "body_timeout_s", None)
    key = "--body-timeout-s"
    if given is None:
        given, key = os.environ.get(BODY_TIMEOUT_ENV) or DEFAULT_BODY_TIMEOUT_S, BODY_TIMEOUT_ENV
    try:
        value = float(given)
    except ValueError:
        raise ConfigError(key, f"must be a number of seconds, got {given!r}") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(key, f"must be a positive number of seconds, got {given!r}")
    return value

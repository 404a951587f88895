"""Serve any environment class of the protocol over HTTP or ZeroMQ.

    hybridflow env-serve mypkg.envs:MazeEnv --options '{"size": 8}' --protocol http --port 8100
    hybridflow env-serve guess_number --protocol zmq --port 5600      # a built-in name

    server = await start_env_server("guess_number", protocol="http", port=0)  # tests, embedding
    server.address     # http://127.0.0.1:PORT/env  (zmq: tcp://127.0.0.1:PORT)
    await server.aclose()

The class is named as the rollout's `env:` is (stages/env/registry.py: `package.module:
Class` or a built-in name; `--options` holds its `env_options` as JSON), one instance per
session. The session state machine is app.py's; the bytes are moved by the reward
service's front ends (reward/server.start_front), so both protocols, the body timeout,
the JSON error bodies and the graceful SIGTERM behave exactly as `reward-serve`'s.

It binds 127.0.0.1 unless `--host` says otherwise: the protocol has no encryption, and
the HTTP bearer token ($HYBRIDFLOW_ENV_TOKEN; clients name the variable holding it in
`env_options.token_env`) only keeps honest neighbours out. ZeroMQ has no token.

`cli_serve` prints one line `hybridflow env-serve: listening on <address>` when ready.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import inspect
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from hybridflow.config.imports import cwd_off_path
from hybridflow.errors import ConfigError
from hybridflow.reward.schema import DEFAULT_MAX_BODY_BYTES
from hybridflow.reward.server import (
    DEFAULT_BODY_TIMEOUT_S,
    Protocol,
    RunningServer,
    serve_until_stopped,
    start_front,
)
from hybridflow.stages.env.registry import make_env_factory
from hybridflow.stages.env.service.app import EnvApp
from hybridflow.stages.env.service.schema import HTTP_PATH, ZMQ_ENV

__all__ = ["TOKEN_ENV", "cli_serve", "start_env_server"]

log = logging.getLogger("hybridflow.env.service")

TOKEN_ENV = "HYBRIDFLOW_ENV_TOKEN"  # the CLI reads the server's bearer token from here


def _factory(env: str | Callable[..., Any], options: Mapping[str, Any] | None) -> tuple:
    if isinstance(env, str):
        with cwd_off_path(allow=True):  # like `python -m`: ./envs.py is importable
            return make_env_factory(env, options), env
    if not callable(env):
        raise ConfigError("env", f"must be a class or 'package.module:Class', got {env!r}")
    opts = dict(options or {})
    name = getattr(env, "__name__", type(env).__name__) if inspect.isclass(env) else repr(env)
    return (lambda: env(**opts)), name


async def start_env_server(
    env: str | Callable[..., Any],
    env_options: Mapping[str, Any] | None = None,
    protocol: Protocol = "http",
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    token: str | None = None,
    call_timeout_s: float = 60.0,
    max_sessions: int = 1024,
    session_ttl_s: float = 600.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    grace_s: float = 10.0,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> RunningServer:
    """Start serving `env` (a class or its config name) on the running loop (port 0: a
    free one); `RunningServer.address` is what `env_options.url` takes."""
    factory, name = _factory(env, env_options)
    core = EnvApp(
        factory,
        name,
        call_timeout_s=call_timeout_s,
        max_sessions=max_sessions,
        session_ttl_s=session_ttl_s,
        max_body_bytes=max_body_bytes,
    )
    return await start_front(
        core,
        protocol,
        host,
        port,
        token=token,
        grace_s=grace_s,
        body_timeout_s=body_timeout_s,
        http_paths=("/", HTTP_PATH),
        http_path=HTTP_PATH,
        zmq_method=ZMQ_ENV,
    )


def _die_with(parent: int) -> None:
    """End this process when `parent` dies: PR_SET_PDEATHSIG on Linux (then check that the
    parent did not die before it was armed), else a watcher thread polling getppid."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            raise SystemExit(f"env-serve: the parent {parent} is gone")
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="hybridflow-env-parent-watch", daemon=True).start()


def cli_serve(args: argparse.Namespace) -> int:
    """`hybridflow env-serve ENV [--options JSON] [--protocol] [--host] [--port]
    [--call-timeout-s] [--max-sessions] [--session-ttl-s]` (the arguments: cli.py); the
    HTTP bearer token, if any, comes from $HYBRIDFLOW_ENV_TOKEN."""
    try:
        options = json.loads(args.options)
    except json.JSONDecodeError as exc:
        raise ConfigError("--options", f"is not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise ConfigError("--options", f"must be a JSON object, got {args.options!r}")
    for key in ("call_timeout_s", "session_ttl_s"):
        if not 0 < getattr(args, key) < float("inf"):
            raise ConfigError(f"--{key.replace('_', '-')}", "must be a positive number of seconds")
    if args.max_sessions < 1:
        raise ConfigError("--max-sessions", f"must be >= 1, got {args.max_sessions}")
    token = (os.environ.get(TOKEN_ENV) or None) if args.protocol == "http" else None
    if token is None and args.protocol == "http" and args.host not in ("127.0.0.1", "::1"):
        log.warning("serving on %s without a bearer token (set %s)", args.host, TOKEN_ENV)
    _factory(args.env, options)  # a bad class or option: a ConfigError now, not at the first call
    if getattr(args, "parent_pid", 0):
        _die_with(args.parent_pid)

    def start() -> Awaitable[RunningServer]:
        return start_env_server(
            args.env,
            options,
            args.protocol,
            args.host,
            args.port,
            token=token,
            call_timeout_s=args.call_timeout_s,
            max_sessions=args.max_sessions,
            session_ttl_s=args.session_ttl_s,
        )

    def ready(address: str) -> None:
        print(f"hybridflow env-serve: listening on {address}", flush=True)

    with contextlib.suppress(KeyboardInterrupt):
        serve_until_stopped(start, ready)
    return 0

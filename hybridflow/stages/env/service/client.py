"""RemoteEnv: an environment that lives in an environment service, as a rollout uses it.

    env: remote                     # hybridflow.stages.env.service.client:RemoteEnv
    env_options:
      url: http://127.0.0.1:8100/env        # or tcp://127.0.0.1:5600 (ZeroMQ)
      timeout_s: 10                         # per attempt
      retries: 3                            # attempts = retries + 1
      backoff_s: 0.2                        # doubling, equal jitter, capped by backoff_max_s
      on_failure: fail                      # or {fallback: 0.0}

One RemoteEnv per trajectory (the registry's convention), one service session each
(`session_id` = <client nonce>-<n>): reset -> step 0, 1, 2, ... -> close. It implements
the same protocol as a local environment (async reset/step/close, tools_schema()), so
the trajectory loop cannot tell the difference. The RemoteEnvs of one event loop share
one transport per service (an aiohttp session / a DEALER socket, reward/transports.py),
opened by the first reset and closed with the last close.

One call, until it succeeds or its retries run out:

    200                    -> schema.decode_reply (protocol errors raise, never retried)
    timeout, connection,
    408/429/5xx retryable  -> sleep backoff (or the server's Retry-After), retry the SAME
                              (session_id, step_id): the service answers a retry from its
                              cache, so a step is never applied twice
    `retryable: false`,
    other 4xx, 3xx         -> EnvServiceError at once (the environment failed, the session
                              is unknown, a redirect is not followed)
    retries spent          -> on_failure "fail": EnvServiceError naming the url, the
                              session, the call and env_options.timeout_s/retries;
                              {fallback: x}: the trajectory ends (done) with reward x and
                              info service_failures 1 (a failed reset keeps the dataset's
                              prompt and ends at the first step), a warning logged

Every step's info carries `service_retries` (the retries its calls needed, the reset's
counted on step 0), so a flaky service shows as env/service_retries. `close` is best
effort: a close that fails is logged, not raised (the service closes idle sessions
itself after its --session-ttl-s).

Bound: one call takes at most `RemoteEnvOptions.budget_s()` (every attempt timing out,
plus the backoffs); keep it below the rollout's `env_timeout_s`, which bounds each call
from outside.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import msgspec

from hybridflow.errors import ConfigError, EnvError, EnvProtocolError, EnvServiceError
from hybridflow.reward.client import RETRYABLE_STATUS, backoff_delay
from hybridflow.reward.schema import DEFAULT_MAX_BODY_BYTES, Encoding
from hybridflow.reward.transports import MalformedAnswer, Transport, TransportFailure
from hybridflow.stages.env.protocol import Action, InfoValue, Observation, StepResult
from hybridflow.stages.env.service.schema import (
    ENV_PROTOCOL_VERSION,
    ZMQ_ENV,
    CloseRequest,
    EnvRequest,
    ResetRequest,
    StepRequest,
    action_to_wire,
    decode_reply,
    error_reply,
    request_id,
)

__all__ = ["RemoteEnv", "RemoteEnvOptions"]

log = logging.getLogger("hybridflow.env.remote")

_NONCE = uuid.uuid4().hex[:12]  # session ids unique across processes and runs
_SESSIONS = itertools.count()
_FAILED = object()  # a call that failed under the fallback policy


def _enc_hook(obj: Any) -> Any:
    """Records from datasets may hold numpy/torch values: sent as their Python values."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"a {type(obj).__name__} cannot be sent to an environment service")


_JSON = msgspec.json.Encoder(enc_hook=_enc_hook)
_MSGPACK = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


@dataclass(frozen=True, kw_only=True)
class RemoteEnvOptions:
    """RemoteEnv's `env_options` (module docstring)."""

    url: str = ""  # http://host:port/env, or tcp://host:port for ZeroMQ
    protocol: str = ""  # "" = from the url: http(s):// -> http, tcp:// / ipc:// -> zmq
    timeout_s: float = 10.0  # per attempt
    retries: int = 3  # attempts = retries + 1, with the same session_id / step_id
    backoff_s: float = 0.2  # first retry waits ~backoff_s, doubling each time, with jitter
    backoff_max_s: float = 5.0  # cap of one backoff wait
    token_env: str | None = None  # the variable holding the HTTP bearer token
    on_failure: Any = "fail"  # "fail" | {"fallback": number}
    max_connections: int = 64  # HTTP connections per service, all trajectories together
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger replies are protocol errors

    @property
    def scheme(self) -> str:
        if self.protocol:
            return self.protocol
        return "zmq" if self.url.startswith(("tcp://", "ipc://", "inproc://")) else "http"

    @property
    def fallback(self) -> float | None:
        if self.on_failure == "fail":
            return None
        value: float = float(self.on_failure["fallback"])
        return value

    def budget_s(self) -> float:
        """The longest one call can take: every attempt timing out, plus the backoffs."""
        waits = sum(min(self.backoff_max_s, self.backoff_s * 2.0**k) for k in range(self.retries))
        return (self.retries + 1) * self.timeout_s + waits

    def validate(self, path: str = "env_options") -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"{path}.{key}", f"{why}, got {getattr(self, key)!r}")

        if self.protocol not in ("", "http", "zmq"):
            raise bad("protocol", "must be http or zmq (or left out: from the url)")
        want = ("http://", "https://") if self.scheme == "http" else ("tcp://", "ipc://")
        if not isinstance(self.url, str) or not self.url.startswith(want):
            raise bad("url", f"a {self.scheme} service needs a url starting with {want[0]}")
        if not 0 < self.timeout_s < math.inf:
            raise bad("timeout_s", "must be > 0 seconds")
        if not isinstance(self.retries, int) or self.retries < 0:
            raise bad("retries", "must be an int >= 0")
        for key in ("backoff_s", "backoff_max_s"):
            if not 0 <= getattr(self, key) < math.inf:
                raise bad(key, "must be >= 0 seconds")
        if self.max_connections < 1:
            raise bad("max_connections", "must be >= 1")
        if self.max_body_bytes < 1024:
            raise bad("max_body_bytes", "must be >= 1024")
        if self.token_env is not None and self.scheme != "http":
            raise bad("token_env", "applies to http services only")
        ok = self.on_failure == "fail" or (
            isinstance(self.on_failure, dict)
            and set(self.on_failure) == {"fallback"}
            and isinstance(self.on_failure["fallback"], int | float)
            and not isinstance(self.on_failure["fallback"], bool)
            and math.isfinite(self.on_failure["fallback"])
        )
        if not ok:
            raise bad("on_failure", "must be 'fail' or {fallback: <finite number>}")

    def token(self, path: str = "env_options") -> str | None:
        import os

        if not self.token_env:
            return None
        value = os.environ.get(self.token_env, "")
        if not value:
            raise ConfigError(
                f"{path}.token_env", f"environment variable {self.token_env!r} is not set or empty"
            )
        return value


class _Shared:
    """The transports of one event loop, one per service, counted by the RemoteEnvs using
    them (the first reset opens one, the last close closes it)."""

    def __init__(self) -> None:
        self._by_loop: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, dict[tuple[Any, ...], list[Any]]
        ] = weakref.WeakKeyDictionary()

    def acquire(self, opts: RemoteEnvOptions) -> Transport:
        pool = self._by_loop.setdefault(asyncio.get_running_loop(), {})
        key = self._key(opts)
        entry = pool.get(key)
        if entry is None:
            entry = pool[key] = [self._make(opts), 0]
        entry[1] += 1
        return entry[0]  # type: ignore[no-any-return]

    def open_transports(self) -> int:
        """Transports open on the running loop (tests)."""
        return len(self._by_loop.get(asyncio.get_running_loop(), {}))

    async def release(self, opts: RemoteEnvOptions) -> None:
        pool = self._by_loop.get(asyncio.get_running_loop(), {})
        key = self._key(opts)
        entry = pool.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del pool[key]
            await entry[0].aclose()

    @staticmethod
    def _key(o: RemoteEnvOptions) -> tuple[Any, ...]:
        return (o.scheme, o.url, o.token_env, o.max_connections, o.max_body_bytes)

    @staticmethod
    def _make(o: RemoteEnvOptions) -> Transport:
        from hybridflow.reward.transports import HttpTransport, ZmqTransport

        if o.scheme == "http":
            return HttpTransport(
                o.url,
                max_connections=o.max_connections,
                max_body_bytes=o.max_body_bytes,
                token=o.token(),
            )
        return ZmqTransport(o.url, max_body_bytes=o.max_body_bytes, method=ZMQ_ENV)


_SHARED = _Shared()


class RemoteEnv:
    """An environment served elsewhere (module docstring); options: RemoteEnvOptions."""

    def __init__(self, **options: Any) -> None:
        self.opts = RemoteEnv.check_options(options)
        self.session_id = f"{_NONCE}-{next(_SESSIONS)}"
        self._transport: Transport | None = None
        self._next_step = 0
        self._tools: list[dict[str, Any]] = []
        self._failed = ""  # why the trajectory ends at its next step (fallback policy)
        self._retries = 0  # retries not yet reported in a step's info
        self._rng = random.Random()

    @staticmethod
    def check_options(options: dict[str, Any], path: str = "env_options") -> RemoteEnvOptions:
        """The validated options (the registry calls this once, when the factory is built)."""
        try:
            opts = RemoteEnvOptions(**options)
        except TypeError as exc:
            raise ConfigError(
                path, f"{exc}; RemoteEnv takes {list(RemoteEnvOptions.__dataclass_fields__)}"
            ) from None
        opts.validate(path)
        return opts

    def tools_schema(self) -> list[dict[str, Any]]:
        """The tools the service's environment declared at reset (for the chat template)."""
        return [dict(t) for t in self._tools]

    async def reset(self, record: dict[str, Any]) -> Observation:
        if self._transport is None:
            self._transport = _SHARED.acquire(self.opts)
        req = ResetRequest(version=ENV_PROTOCOL_VERSION, session_id=self.session_id, record=record)
        out = await self._call(req, "reset")
        if out is _FAILED:
            return Observation.empty()  # the dataset's prompt; the first step ends it
        obs, self._tools = out
        return obs  # type: ignore[no-any-return]

    async def step(self, action: Action) -> StepResult:
        if self._transport is None:
            raise EnvError(
                f"RemoteEnv session {self.session_id}: step before reset", what="RemoteEnv.step"
            )
        if self._failed:
            return self._fallback_result()
        k = self._next_step
        req = StepRequest(
            version=ENV_PROTOCOL_VERSION,
            session_id=self.session_id,
            step_id=k,
            action=action_to_wire(action),
        )
        out = await self._call(req, f"step {k}")
        if out is _FAILED:
            return self._fallback_result()
        self._next_step += 1
        assert isinstance(out, StepResult)
        out.info["service_retries"] = self._retries
        self._retries = 0
        return out

    async def close(self) -> None:
        if self._transport is None:
            return
        try:
            if not self._failed:
                req = CloseRequest(version=ENV_PROTOCOL_VERSION, session_id=self.session_id)
                out = await self._call(req, "close")
                if out is False:
                    log.debug("session %s was already closed", self.session_id)
        except EnvError as exc:  # best effort: the service expires idle sessions itself
            log.warning("%s", exc)
        finally:
            self._transport = None
            await _SHARED.release(self.opts)

    # -- one call ---------------------------------------------------------------------------
    async def _call(self, req: EnvRequest, call: str) -> Any:
        o, transport = self.opts, self._transport
        assert transport is not None
        body = self._encode(req, transport.encoding, call)
        rid = request_id(req)
        last, status, retry_after = "", "", None
        for attempt in range(o.retries + 1):
            if attempt:
                self._retries += 1
                await asyncio.sleep(
                    backoff_delay(attempt, o.backoff_s, o.backoff_max_s, self._rng, retry_after)
                )
            retry_after = None
            try:
                answer = await transport.post(rid, body, o.timeout_s)
            except TransportFailure as exc:
                last, status = str(exc), "unreachable"
                log.info("environment service %s, %s: %s", o.url, rid, last)
                continue
            except MalformedAnswer as exc:
                raise self._error(call, "protocol", str(exc), EnvProtocolError) from exc
            if answer.status == 200:
                return decode_reply(
                    answer.body,
                    transport.encoding,
                    req,
                    url=o.url,
                    call=call,
                    max_body_bytes=o.max_body_bytes,
                )
            err = error_reply(answer.body, transport.encoding)
            last, status = f"status {answer.status}: {err.error[:500]}", str(answer.status)
            if 300 <= answer.status < 400:
                raise self._error(
                    call,
                    status,
                    f"answered {answer.status}, a redirect to {answer.location!r}, which is not followed",
                )
            if answer.status not in RETRYABLE_STATUS or not err.retryable:
                raise self._error(call, status, last)
            retry_after = answer.retry_after_s
            log.info("environment service %s, %s: %s", o.url, rid, last)
        what = (
            f"failed after {o.retries + 1} attempts, each bounded by env_options.timeout_s="
            f"{o.timeout_s:g} s (env_options.retries={o.retries}); last error: {last}"
        )
        if o.fallback is None:
            raise self._error(call, status, what)
        self._failed = what
        log.warning(
            "environment service %s: %s of session %s %s; the trajectory ends with the "
            "fallback reward %s",
            o.url,
            call,
            self.session_id,
            what,
            o.fallback,
        )
        return _FAILED

    def _encode(self, req: EnvRequest, encoding: Encoding, call: str) -> bytes:
        try:
            return _JSON.encode(req) if encoding == "json" else _MSGPACK.encode(req)
        except TypeError as exc:  # the record holds something that has no wire form
            raise EnvError(
                f"RemoteEnv session {self.session_id}: {call}: {exc}", what=f"RemoteEnv.{call}"
            ) from exc

    def _fallback_result(self) -> StepResult:
        assert self.opts.fallback is not None
        info: dict[str, InfoValue] = {"service_failures": 1, "service_retries": self._retries}
        self._retries = 0
        return StepResult(Observation.empty(), self.opts.fallback, done=True, info=info)

    def _error(
        self, call: str, status: str, what: str, cls: type[EnvServiceError] = EnvServiceError
    ) -> EnvServiceError:
        return cls(
            f"environment service {self.opts.url}: {call} of session {self.session_id} {what}",
            url=self.opts.url,
            session_id=self.session_id,
            call=call,
            status=status,
        )

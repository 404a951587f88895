"""The core of an environment server: one environment object per session, calls applied
once. Request bytes in, reply bytes out (a reward/app.py `ServiceCore`), so the reward
service's HTTP and ZeroMQ front ends serve it unchanged.

    app = EnvApp(make_env_factory("guess_number", {}), "guess_number")
    reply = await app.handle(body, "json")       # RequestRejected for non-200 answers

Per session, the state machine (schema.py has the wire side):

    reset(s, record)   new s: build env = factory(), run env.reset(record)  -> cached
                       known s, same record: the cached reply (a retry); other record: 409
    step(s, k, action) k == last+1 (and the last one done): run env.step   -> cached as last
                       k == last: the cached reply, or the running call's (a retry)
                       anything else, a step after done or while one runs: 409
    close(s)           waits for a running call, env.close(), forgets s; unknown s: closed=false

Every environment call runs through protocol.env_call, bounded by `call_timeout_s`
(sync methods in daemon threads, capped by max_stuck); it runs as its own task, so a
client that hangs up or times out never cancels it: the retry finds it. An environment
that raises or times out fails its session for good (500/504, `retryable: false`): its
state is unknown, so the call is never re-run, and a retry gets the same answer.

Bounds: at most `max_sessions` sessions (a reset past it: 503, retryable); a session
idle longer than `session_ttl_s` (a client that died without closing) is closed the next
time any request arrives.

Invariants: an environment method is called at most once per (session, call, step_id);
a session's steps run one at a time, in step_id order; every environment call is bounded.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from hybridflow.errors import EnvError, EnvTimeout
from hybridflow.reward.schema import DEFAULT_MAX_BODY_BYTES, Encoding, RequestRejected
from hybridflow.stages.env.protocol import Observation, StepResult, close_env, env_call
from hybridflow.stages.env.service.schema import (
    ENV_PROTOCOL_VERSION,
    CloseReply,
    CloseRequest,
    EnvErrorReply,
    EnvHealth,
    ResetReply,
    ResetRequest,
    StepReply,
    StepRequest,
    action_from_wire,
    decode_request,
    encode,
    obs_to_wire,
    request_id,
    step_to_wire,
)

__all__ = ["EnvApp"]

log = logging.getLogger("hybridflow.env.service")

_RECORD = msgspec.json.Encoder(order="sorted")


@dataclass
class _Session:
    record_key: bytes  # the reset's record, canonical: tells a retry from a conflict
    reset: asyncio.Future[ResetReply] | None = None  # set as the session is made
    env: Any = None
    step_id: int = -1  # the last step started
    step: asyncio.Future[StepReply] | None = None
    done: bool = False
    failed: str = ""  # why the session cannot go on
    last_used: float = field(default_factory=time.monotonic)

    def running(self) -> list[asyncio.Future[Any]]:
        return [f for f in (self.reset, self.step) if f is not None and not f.done()]


class EnvApp:
    def __init__(
        self,
        factory: Callable[[], Any],
        name: str,
        *,
        call_timeout_s: float = 60.0,
        max_sessions: int = 1024,
        session_ttl_s: float = 600.0,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        setting: str = "--call-timeout-s",
    ) -> None:
        if not call_timeout_s > 0 or max_sessions < 1 or not session_ttl_s > 0:
            raise ValueError("call_timeout_s, session_ttl_s must be > 0 and max_sessions >= 1")
        self.factory, self.name = factory, name
        self.call_timeout_s, self.setting = call_timeout_s, setting
        self.max_sessions, self.session_ttl_s = max_sessions, session_ttl_s
        self.max_body_bytes = max_body_bytes
        self.sessions: dict[str, _Session] = {}
        self.applied = {"reset": 0, "step": 0, "close": 0}  # environment calls made
        self._closing: set[asyncio.Task[None]] = set()

    # -- ServiceCore -----------------------------------------------------------------------
    def health(self, encoding: Encoding) -> bytes:
        return encode(
            EnvHealth(env=self.name, sessions=len(self.sessions), max_sessions=self.max_sessions),
            encoding,
        )

    async def handle(self, body: bytes, encoding: Encoding) -> bytes:
        req = decode_request(body, encoding, max_body_bytes=self.max_body_bytes)
        self._expire()
        reply: msgspec.Struct
        try:
            if isinstance(req, ResetRequest):
                reply = await self._reset(req)
            elif isinstance(req, StepRequest):
                reply = await self._step(req)
            else:
                reply = await self._close(req)
        except RequestRejected as exc:
            if exc.body is None:  # only "at max_sessions" may pass by asking again
                err = _error(exc.message, request_id(req), retryable=exc.status == 503)
                exc.body = encode(err, encoding)
            raise
        except EnvError as exc:  # the environment failed: final for its session
            status = 504 if isinstance(exc, EnvTimeout) else 500
            err = _error(str(exc), request_id(req), retryable=False)
            raise RequestRejected(status, str(exc), encode(err, encoding)) from exc
        return encode(reply, encoding)

    async def aclose(self) -> None:
        """Close every session (each close bounded), then wait for closes under way."""
        for sid in list(self.sessions):
            self._close_later(sid)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    # -- the calls -------------------------------------------------------------------------
    async def _reset(self, req: ResetRequest) -> ResetReply:
        key = _RECORD.encode(req.record)
        s = self.sessions.get(req.session_id)
        if s is None:
            if len(self.sessions) >= self.max_sessions:
                raise RequestRejected(
                    503,
                    f"{len(self.sessions)} sessions open, the server's max_sessions: close "
                    "sessions or raise --max-sessions",
                )
            s = self.sessions[req.session_id] = _Session(record_key=key)
            s.reset = asyncio.ensure_future(self._run_reset(s, req))
            s.reset.add_done_callback(functools.partial(self._settled, s))
        elif s.record_key != key:
            raise RequestRejected(
                409, f"session {req.session_id!r} was already reset with another record"
            )
        s.last_used = time.monotonic()
        assert s.reset is not None
        return await asyncio.shield(s.reset)

    async def _run_reset(self, s: _Session, req: ResetRequest) -> ResetReply:
        env = s.env = await env_call(self.factory, what=f"{self.name}()", **self._bound())
        self.applied["reset"] += 1
        obs = await env_call(
            env.reset, dict(req.record), what=f"{self.name}.reset", **self._bound()
        )
        if not isinstance(obs, Observation):
            raise EnvError(
                f"{self.name}.reset returned a {type(obs).__name__}, not an Observation",
                what=f"{self.name}.reset",
            )
        schema = getattr(env, "tools_schema", None)
        tools = list(schema()) if callable(schema) else []
        return ResetReply(
            version=ENV_PROTOCOL_VERSION,
            session_id=req.session_id,
            observation=obs_to_wire(obs),
            tools=tools,
        )

    async def _step(self, req: StepRequest) -> StepReply:
        s = self._session(req.session_id)
        s.last_used = time.monotonic()
        if req.step_id == s.step_id and s.step is not None:
            return await asyncio.shield(s.step)  # a retry: the same reply, never re-run
        if s.failed:
            raise RequestRejected(409, f"session {req.session_id!r} failed: {s.failed}")
        if s.reset is None or not s.reset.done():
            raise RequestRejected(409, f"session {req.session_id!r} is still being reset")
        if s.step is not None and not s.step.done():
            raise RequestRejected(
                409, f"step {s.step_id} of session {req.session_id!r} is still running"
            )
        if s.done:
            raise RequestRejected(
                409, f"session {req.session_id!r} ended (done) at step {s.step_id}"
            )
        if req.step_id != s.step_id + 1:
            raise RequestRejected(
                409,
                f"session {req.session_id!r} expects step_id {s.step_id + 1} (or "
                f"{s.step_id}, a retry), got {req.step_id}",
            )
        s.step_id = req.step_id
        s.step = asyncio.ensure_future(self._run_step(s, req))
        s.step.add_done_callback(functools.partial(self._settled, s))
        return await asyncio.shield(s.step)

    async def _run_step(self, s: _Session, req: StepRequest) -> StepReply:
        self.applied["step"] += 1
        what = f"{self.name}.step"
        res = await env_call(s.env.step, action_from_wire(req.action), what=what, **self._bound())
        if not isinstance(res, StepResult):
            raise EnvError(f"{what} returned a {type(res).__name__}, not a StepResult", what=what)
        s.done = res.done
        return step_to_wire(req.session_id, req.step_id, res)

    async def _close(self, req: CloseRequest) -> CloseReply:
        s = self.sessions.pop(req.session_id, None)
        if s is not None:
            await self._close_session(req.session_id, s)
        return CloseReply(
            version=ENV_PROTOCOL_VERSION, session_id=req.session_id, closed=s is not None
        )

    # -- sessions --------------------------------------------------------------------------
    def _session(self, session_id: str) -> _Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise RequestRejected(
                404,
                f"unknown session {session_id!r}: never reset, closed, or closed after "
                f"{self.session_ttl_s:g} s idle (--session-ttl-s)",
            )
        return s

    def _settled(self, s: _Session, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            s.failed = str(fut.exception())

    async def _close_session(self, session_id: str, s: _Session) -> None:
        running = s.running()
        if running:  # each is bounded by call_timeout_s
            await asyncio.gather(*running, return_exceptions=True)
        if s.env is not None:
            self.applied["close"] += 1
            await close_env(s.env, timeout_s=self.call_timeout_s)

    def _close_later(self, session_id: str) -> None:
        s = self.sessions.pop(session_id)

        async def close() -> None:
            try:
                await self._close_session(session_id, s)
            except EnvError as exc:  # nobody to answer: logged
                log.warning("closing session %s: %s", session_id, exc)

        task = asyncio.get_running_loop().create_task(close(), name=f"env-close {session_id}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _expire(self) -> None:
        """Close sessions idle past session_ttl_s (their clients are gone)."""
        cutoff = time.monotonic() - self.session_ttl_s
        for sid, s in list(self.sessions.items()):
            if s.last_used < cutoff and not s.running():
                log.info("session %s idle for more than %g s: closing it", sid, self.session_ttl_s)
                self._close_later(sid)

    def _bound(self) -> dict[str, Any]:
        return {"timeout_s": self.call_timeout_s, "setting": self.setting}


def _error(message: str, rid: str, *, retryable: bool) -> EnvErrorReply:
    return EnvErrorReply(error=message, request_id=rid, retryable=retryable)

"""The wire schema of external environment services, version 1: one module, both encodings.

The same structs travel as JSON over HTTP (`POST /env`) and as MessagePack over ZeroMQ
(method frame b"env"). A request is one of three calls, tagged by its `call` field:

    reset  {"call": "reset", "version": 1, "session_id": str, "record": {str: any}}
        -> {"version": 1, "session_id": str, "observation": Obs, "tools": [schema]}
    step   {"call": "step", "version": 1, "session_id": str, "step_id": int >= 0,
            "action": {"text": str, "token_ids": [int], "truncated": bool}}
        -> {"version": 1, "session_id": str, "step_id": int, "observation": Obs,
            "reward": number, "done": bool, "info": {str: number | str}}
    close  {"call": "close", "version": 1, "session_id": str}
        -> {"version": 1, "session_id": str, "closed": bool}

    Obs          {"messages": [{"role": str, "content": str, ...}], "token_ids": [int]}
                 (either, or neither; both keys optional)
    error reply  {"version": 1, "error": str, "request_id": str?, "retryable": bool?}
                 (any non-200 answer; `retryable` false: asking again cannot help)
    health       GET /health (ZeroMQ: method b"health") -> {"version": 1, "status": "ok",
                 "env": str, "sessions": int, "max_sessions": int}

Sessions and idempotency: the client names each trajectory's session (`session_id`,
unique per client and run) and numbers its steps 0, 1, 2, ... A retried call carries
the same session_id and step_id; a service answers a retried reset, or a retried step
(same step_id as the last one), with the reply it already computed (or is computing)
and never applies it twice. The ZeroMQ request_id frame (`request_id()` below) repeats
(session, call, step), so a late reply still routes to the call it answers.

Validation lives here, one function per direction: `decode_request` (server side,
RequestRejected 400/413) and `decode_reply` (client side, EnvProtocolError naming the
service, the session and the call): undecodable bytes, a wrong version, another
session's or step's reply, a reward that is not a finite float32, a malformed
observation or a done step carrying one are protocol errors, never a zero reward.
Unknown keys are ignored both ways (a service may add diagnostics); a change of meaning
bumps `ENV_PROTOCOL_VERSION`. Nothing is ever unpickled: msgspec builds only
dicts/lists/scalars and these structs.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from hybridflow.errors import EnvProtocolError
from hybridflow.reward.schema import Encoding, RequestRejected
from hybridflow.stages.env.protocol import Action, Observation, StepResult

__all__ = [
    "ENV_PROTOCOL_VERSION",
    "HTTP_PATH",
    "ZMQ_ENV",
    "ActionMsg",
    "CloseReply",
    "CloseRequest",
    "EnvErrorReply",
    "EnvHealth",
    "EnvRequest",
    "Obs",
    "ResetReply",
    "ResetRequest",
    "StepReply",
    "StepRequest",
    "decode_reply",
    "decode_request",
    "encode",
    "request_id",
]

ENV_PROTOCOL_VERSION = 1
HTTP_PATH = "/env"  # POST here (or to /); GET /health
ZMQ_ENV = b"env"  # the ZeroMQ method frame of a call; health checks use b"health"

SessionId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
StepId = Annotated[int, msgspec.Meta(ge=0)]
InfoValue = int | float | str


class Obs(msgspec.Struct, frozen=True, omit_defaults=True):
    messages: list[dict[str, Any]] = msgspec.field(default_factory=list)
    token_ids: list[int] = msgspec.field(default_factory=list)


class ActionMsg(msgspec.Struct, frozen=True):
    text: str
    token_ids: list[int] = msgspec.field(default_factory=list)
    truncated: bool = False


class ResetRequest(msgspec.Struct, frozen=True, tag="reset", tag_field="call"):
    version: int
    session_id: SessionId
    record: dict[str, Any] = msgspec.field(default_factory=dict)


class StepRequest(msgspec.Struct, frozen=True, tag="step", tag_field="call"):
    version: int
    session_id: SessionId
    step_id: StepId
    action: ActionMsg


class CloseRequest(msgspec.Struct, frozen=True, tag="close", tag_field="call"):
    version: int
    session_id: SessionId


EnvRequest = ResetRequest | StepRequest | CloseRequest


class ResetReply(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    session_id: str
    observation: Obs = msgspec.field(default_factory=Obs)
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)


class StepReply(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    session_id: str
    step_id: int
    observation: Obs = msgspec.field(default_factory=Obs)
    reward: float = 0.0  # numbers only: a bool or a string is a protocol error
    done: bool = False
    info: dict[str, InfoValue] = msgspec.field(default_factory=dict)


class CloseReply(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    session_id: str
    closed: bool = True  # False: the service did not know the session (already closed)


class EnvErrorReply(msgspec.Struct, frozen=True):
    error: str
    version: int = ENV_PROTOCOL_VERSION
    request_id: str | None = None
    retryable: bool = True


class EnvHealth(msgspec.Struct, frozen=True):
    version: int = ENV_PROTOCOL_VERSION
    status: str = "ok"
    env: str = ""
    sessions: int = 0
    max_sessions: int = 0


def request_id(req: EnvRequest) -> str:
    """The ZeroMQ request_id frame: the same for every retry of one call."""
    if isinstance(req, StepRequest):
        return f"{req.session_id}/step/{req.step_id}"
    return f"{req.session_id}/{'reset' if isinstance(req, ResetRequest) else 'close'}"


_JSON, _MSGPACK = msgspec.json.Encoder(), msgspec.msgpack.Encoder()
_TYPES: tuple[Any, ...] = (EnvRequest, ResetReply, StepReply, CloseReply, EnvErrorReply, EnvHealth)
_DECODERS = {
    (enc, tp): (msgspec.json.Decoder if enc == "json" else msgspec.msgpack.Decoder)(tp)
    for enc in ("json", "msgpack")
    for tp in _TYPES
}


def encode(obj: msgspec.Struct, encoding: Encoding) -> bytes:
    return _JSON.encode(obj) if encoding == "json" else _MSGPACK.encode(obj)


def decode_as(data: bytes, tp: Any, encoding: Encoding) -> Any:
    """Decode `data` as `tp`; raises msgspec.DecodeError / ValidationError."""
    return _DECODERS[(encoding, tp)].decode(data)


def error_reply(data: bytes, encoding: Encoding) -> EnvErrorReply:
    """A non-200 body as an error reply; one that is not (a proxy's HTML page) becomes
    a retryable reply quoting its first bytes."""
    try:
        reply: EnvErrorReply = decode_as(data, EnvErrorReply, encoding)
        return reply
    except (msgspec.DecodeError, msgspec.ValidationError):
        return EnvErrorReply(error=repr(data[:300]))


# -- conversions between the protocol's objects and the wire -------------------------------


def obs_to_wire(obs: Observation) -> Obs:
    return Obs(messages=[dict(m) for m in obs.messages], token_ids=list(obs.token_ids))


def obs_from_wire(obs: Obs) -> Observation:
    """ValueError when it is not an Observation (both kinds, a bad message, bad ids)."""
    return Observation(messages=tuple(obs.messages), token_ids=tuple(obs.token_ids))


def action_to_wire(action: Action) -> ActionMsg:
    return ActionMsg(action.text, list(action.token_ids), action.truncated)


def action_from_wire(action: ActionMsg) -> Action:
    return Action(action.text, tuple(action.token_ids), action.truncated)


def step_to_wire(session_id: str, step_id: int, res: StepResult) -> StepReply:
    # a bool counter is an int on the wire (JSON true would not decode as a number)
    info = {k: int(v) if isinstance(v, bool) else v for k, v in res.info.items()}
    return StepReply(
        version=ENV_PROTOCOL_VERSION,
        session_id=session_id,
        step_id=step_id,
        observation=obs_to_wire(res.observation),
        reward=res.reward,
        done=res.done,
        info=info,
    )


# -- validation, one function per direction ------------------------------------------------


def decode_request(data: bytes, encoding: Encoding, *, max_body_bytes: int) -> EnvRequest:
    """Parse and validate one request body: 413 for size, 400 for everything malformed."""
    if len(data) > max_body_bytes:
        raise RequestRejected(413, f"body of {len(data)} bytes exceeds {max_body_bytes}")
    try:
        req: EnvRequest = decode_as(data, EnvRequest, encoding)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RequestRejected(400, f"malformed request: {exc}") from exc
    if req.version != ENV_PROTOCOL_VERSION:
        raise RequestRejected(
            400, f"unsupported version {req.version}; this server speaks {ENV_PROTOCOL_VERSION}"
        )
    return req


def decode_reply(
    data: bytes,
    encoding: Encoding,
    req: EnvRequest,
    *,
    url: str,
    call: str,
    max_body_bytes: int,
) -> Observation | StepResult | bool | tuple[Observation, list[dict[str, Any]]]:
    """Validate a 200 reply against the request it answers. Returns, per call: reset ->
    (Observation, tools), step -> StepResult, close -> whether the service knew the
    session. Anything else raises EnvProtocolError naming url, session and call."""

    def bad(what: str) -> EnvProtocolError:
        return EnvProtocolError(
            f"environment service {url} broke the protocol on {call} of session "
            f"{req.session_id!r}: {what}",
            url=url,
            session_id=req.session_id,
            call=call,
            status="protocol",
        )

    if len(data) > max_body_bytes:
        raise bad(f"reply of {len(data)} bytes exceeds max_body_bytes={max_body_bytes}")
    tp = (
        ResetReply
        if isinstance(req, ResetRequest)
        else StepReply
        if isinstance(req, StepRequest)
        else CloseReply
    )
    try:
        reply = decode_as(data, tp, encoding)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise bad(f"malformed reply ({exc}); starts with {data[:120]!r}") from exc
    if reply.version != ENV_PROTOCOL_VERSION:
        raise bad(f"reply version {reply.version}, this client speaks {ENV_PROTOCOL_VERSION}")
    if reply.session_id != req.session_id:
        raise bad(f"reply is for session {reply.session_id!r}")
    try:
        if isinstance(reply, ResetReply):
            return obs_from_wire(reply.observation), list(reply.tools)
        if isinstance(reply, StepReply):
            assert isinstance(req, StepRequest)
            if reply.step_id != req.step_id:
                raise bad(f"reply is for step {reply.step_id}")
            return StepResult(
                obs_from_wire(reply.observation), reply.reward, reply.done, dict(reply.info)
            )
    except ValueError as exc:  # Observation / StepResult checks (reward, done, messages)
        raise bad(str(exc)) from exc
    return bool(reply.closed)

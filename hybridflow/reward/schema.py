"""The wire schema of external reward services, version 1: one module, both encodings.

The same structs travel as JSON over HTTP and as MessagePack over ZeroMQ:

    ScoreRequest  {"version": 1, "request_id": str, "step": int, "mb_id": int,
                   "items": [{"id": str, "prompt": str, "response": str,
                              "prompt_ids": [int], "response_ids": [int],
                              "metadata": {str: any JSON value}}]}
    ScoreReply    {"version": 1, "request_id": str?,
                   "rewards": [{"id": str, "reward": number, "info": {str: scalar}?}]}
    ErrorReply    {"version": 1, "error": str, "request_id": str?}   (any non-200 answer)
    Health        {"version": 1, "status": "ok", "max_batch": int}

Variant on the issue's schema, and why: `request_id` is added to both the request and
the reply. A batch that is retried (after a timeout the service may well have scored it)
carries the same `request_id` and the same sample ids, so a service can answer a retry
from a cache instead of scoring twice (the SDK server does), and a client that sees two
replies for one request (ZeroMQ delivers late replies) accepts the first and drops the
rest. Sample ids are opaque strings, unique within a run; a service echoes them back.

The reply's `request_id` is optional, and checked only when present: the minimal reply
`{"version": 1, "rewards": [{"id", "reward"}]}` is valid. Nothing needs it for matching:
an HTTP response answers the request it came on, and over ZeroMQ replies are routed by
the request_id *frame* (below), which stays required. The sample ids, always checked
against the request, are what keeps a reply from being counted for the wrong samples.

Validation lives here, in exactly two functions, one per direction:
  - `decode_request` (server side) raises `RequestRejected(status, message)`;
  - `decode_reply`   (client side) raises `RewardProtocolError` naming the service and
    the sample ids. Missing, extra or duplicate ids, a wrong count, NaN/inf, a number
    beyond float32's range (it would become inf in the float32 `rewards` tensor),
    non-numbers, an oversize body, a wrong version or a request_id that is present but
    not the request's are all protocol errors: a broken reply never turns into a zero.

Unknown keys are ignored in both directions so that a service can add diagnostics and a
future client can add fields without a version bump; anything that changes the meaning
of an existing field bumps `PROTOCOL_VERSION`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from hybridflow.errors import RewardProtocolError

PROTOCOL_VERSION = 1
DEFAULT_MAX_BODY_BYTES = 32 << 20  # 32 MiB: a batch of 256 samples x 16k tokens fits twice
# Rewards land in a float32 tensor: anything larger in magnitude would become +-inf there.
FLOAT32_MAX = 3.4028234663852886e38

Encoding = Literal["json", "msgpack"]
SampleId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Scalar = int | float | str | bool | None


class Item(msgspec.Struct, frozen=True):
    """One sample to score. Text is empty when the client has no tokenizer (ids always set)."""

    id: SampleId
    prompt: str = ""
    response: str = ""
    prompt_ids: list[int] = msgspec.field(default_factory=list)
    response_ids: list[int] = msgspec.field(default_factory=list)
    # Any JSON value (a verifier needs `answer`, a sandbox its test cases). msgspec builds
    # only dicts/lists/scalars from it: nothing is constructed or evaluated.
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)


class ScoreRequest(msgspec.Struct, frozen=True):
    version: int
    items: list[Item]
    request_id: str = ""  # "" = the caller does not want idempotent retries
    step: int = 0
    mb_id: int = 0


class Reward(msgspec.Struct, frozen=True, omit_defaults=True):  # no "info": null on the wire
    id: SampleId
    reward: float  # JSON/msgpack number; ints accepted, bools and strings refused
    info: dict[str, Scalar] | None = None


class ScoreReply(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    version: int
    request_id: str | None = None  # optional (module docstring); null reads as absent
    rewards: list[Reward]


class ErrorReply(msgspec.Struct, frozen=True):
    error: str
    version: int = PROTOCOL_VERSION
    request_id: str | None = None


class Health(msgspec.Struct, frozen=True):
    version: int = PROTOCOL_VERSION
    status: str = "ok"
    max_batch: int = 0


# ZeroMQ framing (DEALER client, ROUTER server; the ROUTER's identity frame not shown):
#   request  [method, request_id, body]     method: ZMQ_SCORE or ZMQ_HEALTH (body b"")
#   reply    [status, request_id, body]     status: ASCII HTTP code, e.g. b"200", b"413"
# The request_id frame repeats the body's field so that a reply can be routed to its
# caller even when its body is garbage (the garbage is then reported, not timed out).
# Status codes mean exactly what they mean over HTTP, so retry rules are shared.
ZMQ_SCORE = b"score"
ZMQ_HEALTH = b"health"


# One encoder/decoder per (encoding, type), built once: msgspec decoders are reusable and
# validate while they parse.
_ENCODERS = {"json": msgspec.json.Encoder(), "msgpack": msgspec.msgpack.Encoder()}
_DECODERS = {
    (enc, tp): (msgspec.json.Decoder if enc == "json" else msgspec.msgpack.Decoder)(tp)
    for enc in ("json", "msgpack")
    for tp in (ScoreRequest, ScoreReply, ErrorReply, Health)
}


def encode(obj: msgspec.Struct, encoding: Encoding) -> bytes:
    return _ENCODERS[encoding].encode(obj)


def decode_as(data: bytes, tp: type, encoding: Encoding):
    """Decode `data` as `tp`; raises msgspec.DecodeError / ValidationError (callers translate)."""
    return _DECODERS[(encoding, tp)].decode(data)


def error_text(data: bytes, encoding: Encoding, limit: int = 500) -> str:
    """The `error` of an ErrorReply body, or a printable prefix of whatever was sent."""
    try:
        return decode_as(data, ErrorReply, encoding).error[:limit]
    except (msgspec.DecodeError, msgspec.ValidationError):
        return repr(data[:limit])


# ---------------------------------------------------------------------------------------
# Server side: requests


@dataclass
class RequestRejected(Exception):
    """A request a server refuses; `status` is the HTTP-style code the client sees.
    `body`, when set, is the encoded error reply to send as it is (a service whose error
    replies carry more than ErrorReply, e.g. the environment service's `retryable`);
    else the front end encodes an ErrorReply from `message`."""

    status: int
    message: str
    body: bytes | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"


def decode_request(
    data: bytes, encoding: Encoding, *, max_body_bytes: int, max_batch: int
) -> ScoreRequest:
    """Parse and validate one request body: 413 for size, 400 for everything malformed."""
    if len(data) > max_body_bytes:
        raise RequestRejected(413, f"body of {len(data)} bytes exceeds {max_body_bytes}")
    try:
        req = decode_as(data, ScoreRequest, encoding)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RequestRejected(400, f"malformed request: {exc}") from exc
    if req.version != PROTOCOL_VERSION:
        raise RequestRejected(
            400, f"unsupported version {req.version}; this server speaks {PROTOCOL_VERSION}"
        )
    if len(req.items) > max_batch:
        raise RequestRejected(
            413, f"{len(req.items)} items exceed this server's max_batch={max_batch}"
        )
    seen: set[str] = set()
    for item in req.items:
        if item.id in seen:
            raise RequestRejected(400, f"duplicate item id {item.id!r}")
        seen.add(item.id)
    return req


# ---------------------------------------------------------------------------------------
# Client side: replies


def decode_reply(
    data: bytes,
    encoding: Encoding,
    request: ScoreRequest,
    *,
    service: str,
    max_body_bytes: int,
) -> dict[str, Reward]:
    """Validate a 200 reply against the request it answers; returns id -> Reward.

    Every id of the request appears exactly once, nothing else does, every reward is a
    number finite in float32. Anything else raises RewardProtocolError naming service and
    ids.
    """
    ids = tuple(item.id for item in request.items)

    def bad(what: str) -> RewardProtocolError:
        shown = ", ".join(ids[:8]) + (f", ... ({len(ids)} in all)" if len(ids) > 8 else "")
        return RewardProtocolError(
            f"reward service {service} broke the protocol on request {request.request_id!r}: "
            f"{what} (samples: {shown})",
            service=service,
            status="protocol",
            sample_ids=ids,
        )

    if len(data) > max_body_bytes:
        raise bad(f"reply of {len(data)} bytes exceeds max_body_bytes={max_body_bytes}")
    try:
        reply = decode_as(data, ScoreReply, encoding)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise bad(f"malformed reply ({exc}); starts with {data[:120]!r}") from exc
    if reply.version != PROTOCOL_VERSION:
        raise bad(f"reply version {reply.version}, this client speaks {PROTOCOL_VERSION}")
    if request.request_id and reply.request_id not in (None, request.request_id):
        raise bad(f"reply is for request_id {reply.request_id!r}")
    out: dict[str, Reward] = {}
    for r in reply.rewards:
        if r.id in out:
            raise bad(f"duplicate id {r.id!r} in reply")
        if not math.isfinite(r.reward):
            raise bad(f"reward for {r.id!r} is {r.reward} (must be finite)")
        if abs(r.reward) > FLOAT32_MAX:
            raise bad(
                f"reward for {r.id!r} is {r.reward}, beyond float32's range "
                f"(|reward| <= {FLOAT32_MAX:.4g}; it would become inf in training)"
            )
        out[r.id] = r
    wanted = set(ids)
    extra = sorted(set(out) - wanted)
    missing = [i for i in ids if i not in out]
    if extra or missing:
        raise bad(
            f"{len(reply.rewards)} rewards for {len(ids)} items; "
            f"missing ids {missing[:8]}, unknown ids {extra[:8]}"
        )
    return out

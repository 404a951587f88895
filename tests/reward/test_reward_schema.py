"""The wire schema: round trips in both encodings, and every way a reply or request can be
wrong -> the right error (never a zero)."""

from __future__ import annotations

import json

import msgspec
import pytest

from hybridflow.errors import RewardProtocolError, RewardServiceError
from hybridflow.reward.schema import (
    Item,
    RequestRejected,
    Reward,
    ScoreReply,
    ScoreRequest,
    decode_as,
    decode_reply,
    decode_request,
    encode,
)

REQ = ScoreRequest(
    version=1,
    request_id="abc-1-0-0",
    step=1,
    mb_id=0,
    items=[
        Item(
            id="1-0-0",
            prompt="2+2=",
            response="4",
            prompt_ids=[5, 6],
            response_ids=[7],
            metadata={"answer": 4, "tag": "x", "w": 0.5, "ok": True, "none": None},
        ),
        Item(id="1-0-1", prompt_ids=[5], response_ids=[]),
    ],
)


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_round_trip(encoding):
    assert decode_as(encode(REQ, encoding), ScoreRequest, encoding) == REQ
    reply = ScoreReply(
        version=1,
        request_id="abc-1-0-0",
        rewards=[
            Reward(id="1-0-0", reward=1.0, info={"judge": 0.5}),
            Reward(id="1-0-1", reward=-2.5),
        ],
    )
    assert decode_as(encode(reply, encoding), ScoreReply, encoding) == reply


def test_json_wire_shape_is_the_documented_one():
    wire = json.loads(encode(REQ, "json"))
    assert set(wire) == {"version", "request_id", "step", "mb_id", "items"}
    assert set(wire["items"][0]) == {
        "id",
        "prompt",
        "response",
        "prompt_ids",
        "response_ids",
        "metadata",
    }


def _rewards(*pairs):
    return [{"id": i, "reward": r} for i, r in pairs]


def _reply(rewards, version=1, request_id="abc-1-0-0"):
    return {"version": version, "request_id": request_id, "rewards": rewards}


BAD_REPLIES = [
    ("missing id", _reply(_rewards(("1-0-0", 1.0))), "missing ids ['1-0-1']"),
    ("extra id", _reply(_rewards(("1-0-0", 1.0), ("1-0-1", 1.0), ("9", 1.0))), "unknown ids ['9']"),
    ("duplicate id", _reply(_rewards(("1-0-0", 1.0), ("1-0-0", 2.0))), "duplicate id '1-0-0'"),
    ("wrong count", _reply([]), "0 rewards for 2 items"),
    ("NaN", _reply(_rewards(("1-0-0", float("nan")), ("1-0-1", 1.0))), "is nan"),
    ("inf", _reply(_rewards(("1-0-0", float("inf")), ("1-0-1", 1.0))), "is inf"),
    # finite as a float64, inf as the float32 reward tensor: refused, naming the service
    ("float32 overflow", _reply(_rewards(("1-0-0", 1e39), ("1-0-1", 1.0))), "beyond float32"),
    ("float32 -overflow", _reply(_rewards(("1-0-0", 1.0), ("1-0-1", -1e39))), "is -1e+39, beyond"),
    ("string", _reply(_rewards(("1-0-0", "1.0"), ("1-0-1", 1.0))), "Expected `float`, got `str`"),
    ("bool", _reply(_rewards(("1-0-0", True), ("1-0-1", 1.0))), "Expected `float`, got `bool`"),
    ("null", _reply(_rewards(("1-0-0", None), ("1-0-1", 1.0))), "Expected `float`, got `"),
    ("version", _reply(_rewards(("1-0-0", 1), ("1-0-1", 1)), version=2), "reply version 2"),
    ("request_id", _reply(_rewards(("1-0-0", 1), ("1-0-1", 1)), request_id="other"), "'other'"),
    (
        "no rewards key",
        {"version": 1, "request_id": "abc-1-0-0"},
        "missing required field `rewards`",
    ),
]


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
@pytest.mark.parametrize(("case", "reply", "needle"), BAD_REPLIES, ids=[c[0] for c in BAD_REPLIES])
def test_bad_reply_is_a_protocol_error(encoding, case, reply, needle):
    if encoding == "json" and case in ("NaN", "inf"):
        data = json.dumps(reply).encode()  # Python writes NaN/Infinity: not JSON at all
        needle = "malformed reply"
    else:
        data = msgspec.json.encode(reply) if encoding == "json" else msgspec.msgpack.encode(reply)
    with pytest.raises(RewardProtocolError) as info:
        decode_reply(data, encoding, REQ, service="svc://x", max_body_bytes=1 << 20)
    err = info.value
    assert isinstance(err, RewardServiceError)
    assert needle in str(err)
    assert "svc://x" in str(err) and "1-0-0, 1-0-1" in str(err)
    assert err.sample_ids == ("1-0-0", "1-0-1") and err.status == "protocol"


def test_json_overflow_garbage_and_oversize():
    for data, needle in [
        (
            b'{"version":1,"request_id":"abc-1-0-0","rewards":[{"id":"1-0-0","reward":1e999}]}',
            "out of range",
        ),
        (b"<html>502 Bad Gateway</html>", "malformed reply"),
        (b"", "malformed reply"),
        (b"x" * 2048, "exceeds max_body_bytes=1024"),
    ]:
        with pytest.raises(RewardProtocolError, match=needle):
            decode_reply(data, "json", REQ, service="s", max_body_bytes=1024)


def test_good_reply_in_any_order():
    data = msgspec.json.encode(_reply(_rewards(("1-0-1", 2), ("1-0-0", -1.5))))
    out = decode_reply(data, "json", REQ, service="s", max_body_bytes=1 << 20)
    assert {k: v.reward for k, v in out.items()} == {"1-0-0": -1.5, "1-0-1": 2.0}


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "malformed request"),
        (b'{"version": 2, "items": []}', 400, "unsupported version 2"),
        (b'{"version": 1}', 400, "missing required field `items`"),
        (b'{"version": 1, "items": [{"id": ""}]}', 400, "length >= 1"),
        (b'{"version": 1, "items": [{"id": "a"}, {"id": "a"}]}', 400, "duplicate item id 'a'"),
        (b'{"version": 1, "items": [{"id": "a"}, {"id": "b"}, {"id": "c"}]}', 413, "max_batch=2"),
        (b"x" * 5000, 413, "exceeds 4096"),
    ],
)
def test_bad_request_is_rejected_with_a_status(body, status, needle):
    with pytest.raises(RequestRejected) as info:
        decode_request(body, "json", max_body_bytes=4096, max_batch=2)
    assert info.value.status == status and needle in info.value.message


def test_minimal_request_decodes_with_defaults():
    req = decode_request(
        b'{"version": 1, "items": [{"id": "a", "response": "hi"}]}',
        "json",
        max_body_bytes=4096,
        max_batch=2,
    )
    assert req.request_id == "" and req.items[0].prompt_ids == [] and req.items[0].metadata == {}

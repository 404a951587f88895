"""The environment service's wire schema (stages/env/service/schema.py): a round trip per
struct in both encodings, validation in both directions, and the ZeroMQ frame layout."""

from __future__ import annotations

import asyncio
import math

import msgspec
import pytest
import zmq
import zmq.asyncio

from hybridflow.errors import EnvProtocolError
from hybridflow.reward.schema import RequestRejected
from hybridflow.stages.env.protocol import Action, Observation, StepResult
from hybridflow.stages.env.service import schema as s
from hybridflow.stages.env.service.client import RemoteEnv

OBS = s.Obs(messages=[{"role": "tool", "content": "4", "name": "calc"}])
STRUCTS = [
    s.ResetRequest(version=1, session_id="a-0", record={"x": [1, {"y": None}]}),
    s.StepRequest(version=1, session_id="a-0", step_id=3, action=s.ActionMsg("hi", [5, 6], True)),
    s.CloseRequest(version=1, session_id="a-0"),
    s.ResetReply(version=1, session_id="a-0", observation=OBS, tools=[{"type": "function"}]),
    s.StepReply(version=1, session_id="a-0", step_id=3, reward=0.5, done=True, info={"n": 1}),
    s.CloseReply(version=1, session_id="a-0", closed=False),
    s.EnvErrorReply(error="boom", request_id="a-0/close", retryable=False),
    s.EnvHealth(env="E", sessions=2, max_sessions=8),
]


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
@pytest.mark.parametrize("obj", STRUCTS, ids=lambda o: type(o).__name__)
def test_round_trip(obj, encoding):
    tp = (
        s.EnvRequest
        if isinstance(obj, s.ResetRequest | s.StepRequest | s.CloseRequest)
        else type(obj)
    )
    assert s.decode_as(s.encode(obj, encoding), tp, encoding) == obj


def test_requests_are_tagged_by_call_and_validated():
    assert b'"call":"step"' in s.encode(STRUCTS[1], "json")
    ok = s.decode_request(s.encode(STRUCTS[0], "json"), "json", max_body_bytes=1 << 20)
    assert ok == STRUCTS[0] and s.request_id(ok) == "a-0/reset"
    assert s.request_id(STRUCTS[1]) == "a-0/step/3"
    bad = [
        (b'{"call": "jump", "version": 1, "session_id": "a"}', 400, "Invalid value 'jump'"),
        (
            b'{"call": "step", "version": 1, "session_id": "a", "step_id": -1, "action": {"text": ""}}',
            400,
            ">= 0",
        ),
        (b'{"call": "close", "version": 1, "session_id": ""}', 400, "length >= 1"),
        (b'{"call": "close", "version": 9, "session_id": "a"}', 400, "unsupported version 9"),
        (b"x" * 100, 413, "exceeds 50"),
    ]
    for body, status, needle in bad:
        with pytest.raises(RequestRejected) as exc:
            s.decode_request(body, "json", max_body_bytes=50 if status == 413 else 1 << 20)
        assert exc.value.status == status and needle in exc.value.message, body


def test_replies_are_checked_against_their_request():
    req = STRUCTS[1]

    def reply(**kw):
        base = {"version": 1, "session_id": "a-0", "step_id": 3, "reward": 1.0, "done": False}
        return msgspec.json.encode({**base, **kw})

    def check(data):
        return s.decode_reply(data, "json", req, url="U", call="step 3", max_body_bytes=1 << 20)

    res = check(reply(observation={"token_ids": [1, 2]}, info={"k": "v"}))
    assert res == StepResult(Observation.from_tokens([1, 2]), 1.0, False, {"k": "v"})
    cases = [
        (reply(session_id="other"), "for session 'other'"),
        (reply(step_id=2), "for step 2"),
        (reply(version=2), "reply version 2"),
        (reply(reward=True), "Expected `float`"),
        (reply(reward=1e39), "float32"),
        (reply(done=True, observation={"messages": [{"role": "user", "content": "x"}]}), "done"),
        (reply(observation={"messages": [{"role": "user"}]}), "'content'"),
        (b"{not json", "malformed reply"),
    ]
    for data, needle in cases:
        with pytest.raises(EnvProtocolError, match="broke the protocol on step 3") as exc:
            check(data)
        assert needle in str(exc.value) and exc.value.session_id == "a-0", needle
    nan = msgspec.json.encode({"version": 1, "session_id": "a-0", "step_id": 3, "reward": math.nan})
    with pytest.raises(EnvProtocolError):
        check(nan)  # JSON has no NaN: msgspec writes null, which is no number


def test_conversions_keep_what_the_protocol_objects_hold():
    a = Action("t", (1, 2), truncated=True)
    assert s.action_from_wire(s.action_to_wire(a)) == a
    res = StepResult(
        Observation.from_messages([{"role": "user", "content": "c"}]), 2.0, False, {"b": True}
    )
    wire = s.step_to_wire("a-0", 1, res)
    assert wire.info == {"b": 1} and s.obs_from_wire(wire.observation) == res.observation


async def test_zmq_frame_layout():
    """A call is [method b"env", request_id, msgpack body]; a reply [status, request_id, body]."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    env = RemoteEnv(url=f"tcp://127.0.0.1:{port}", timeout_s=5, retries=0)
    try:
        pending = asyncio.ensure_future(env.reset({"q": 1}))
        ident, method, rid, body = await asyncio.wait_for(router.recv_multipart(), 5)
        assert method == b"env" and rid == f"{env.session_id}/reset".encode()
        req = s.decode_as(body, s.EnvRequest, "msgpack")
        assert req == s.ResetRequest(version=1, session_id=env.session_id, record={"q": 1})
        reply = s.ResetReply(version=1, session_id=env.session_id)
        await router.send_multipart([ident, b"200", rid, s.encode(reply, "msgpack")])
        assert (await asyncio.wait_for(pending, 5)) == Observation.empty()
    finally:
        env._failed = "skip the close call"
        await env.close()
        router.close(linger=0)
        ctx.term()

"""The server SDK as a third-party client sees it: raw HTTP (aiohttp) and raw DEALER frames."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from hybridflow.errors import ConfigError
from hybridflow.reward import start_server
from hybridflow.reward.server import load_function


def length_fn(prompts, responses, prompt_ids, response_ids, metadata):
    return [float(len(r)) for r in response_ids]


def body(n: int, request_id: str = "", version: int = 1) -> bytes:
    items = [{"id": f"s{i}", "response_ids": list(range(i))} for i in range(n)]
    return json.dumps({"version": version, "request_id": request_id, "items": items}).encode()


async def post(url: str, data: bytes, **kw) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(url, data=data, **kw) as r:
        assert r.content_type == "application/json"
        return r.status, await r.json()


async def test_http_health_and_score():
    async with await start_server(length_fn, "http", port=0, max_batch=4) as srv:
        async with (
            aiohttp.ClientSession() as s,
            s.get(srv.address.replace("/score", "/health")) as r,
        ):
            assert r.status == 200 and await r.json() == {
                "version": 1,
                "status": "ok",
                "max_batch": 4,
            }
        status, reply = await post(srv.address, body(3, "r1"))
        assert status == 200
        assert reply == {
            "version": 1,
            "request_id": "r1",
            "rewards": [{"id": f"s{i}", "reward": float(i)} for i in range(3)],
        }
        root = srv.address.removesuffix("score")
        assert (await post(root, body(1)))[0] == 200  # POST / works too


@pytest.mark.parametrize(
    ("data", "status", "needle"),
    [
        (b"{nope", 400, "malformed request"),
        (body(1, version=3), 400, "unsupported version 3"),
        (body(5), 413, "max_batch=4"),
        (b"x" * 3000, 413, "exceeds 2048"),
    ],
)
async def test_http_bad_requests_get_4xx_json(data, status, needle):
    async with await start_server(
        length_fn, "http", port=0, max_batch=4, max_body_bytes=2048
    ) as srv:
        got, reply = await post(srv.address, data)
    assert got == status and needle in reply["error"] and reply["version"] == 1


async def test_http_unknown_route_and_method_are_json():
    async with await start_server(length_fn, "http", port=0) as srv:
        assert (await post(srv.address.replace("/score", "/nope"), b"{}"))[0] == 404
        async with aiohttp.ClientSession() as s, s.get(srv.address) as r:
            assert r.status == 405 and (await r.json())["error"]


def raises(prompts, responses, prompt_ids, response_ids, metadata):
    raise RuntimeError("sandbox exploded")


def short(prompts, *a, **k):
    return [1.0] * (len(prompts) - 1)


def nan(prompts, *a, **k):
    return [float("nan")] * len(prompts)


def text(prompts, *a, **k):
    return ["1"] * len(prompts)


def a_dict(prompts, *a, **k):
    return {"score": [1.0] * len(prompts)}


def huge(prompts, *a, **k):
    return [0.0, 1e39][: len(prompts)]


@pytest.mark.parametrize(
    ("fn", "needle"),
    [
        (raises, "raised RuntimeError: sandbox exploded"),
        (short, "returned 1 values for 2 samples"),
        (nan, "returned nan at index 0; rewards must be finite"),
        (text, "returned '1' at index 0; str, expected a number"),
        (a_dict, "returned a dict with keys ['score'], expected a list of 2 numbers"),
        (huge, "returned 1e+39 at index 1; beyond float32's range"),
    ],
)
async def test_function_errors_are_500_with_the_message(fn, needle, caplog):
    async with await start_server(fn, "http", port=0) as srv:
        status, reply = await post(srv.address, body(2, "r"))
    assert status == 500 and needle in reply["error"] and fn.__name__ in reply["error"]


async def test_failed_call_is_not_cached_and_conflicting_ids_are_409():
    calls = []

    def flaky(prompts, *a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("first call fails")
        return [2.0] * len(prompts)

    async with await start_server(flaky, "http", port=0) as srv:
        assert (await post(srv.address, body(2, "same")))[0] == 500
        status, reply = await post(srv.address, body(2, "same"))
        assert status == 200 and [r["reward"] for r in reply["rewards"]] == [2.0, 2.0]
        assert (await post(srv.address, body(2, "same")))[0] == 200  # cached: no third call
        status, reply = await post(srv.address, body(3, "same"))
        assert status == 409 and "already used" in reply["error"]
    assert len(calls) == 2


async def test_zmq_frames_health_and_errors():
    async with await start_server(length_fn, "zmq", port=0, max_batch=4) as srv:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(srv.address)
        try:

            async def ask(*frames):
                await sock.send_multipart(list(frames))
                return await asyncio.wait_for(sock.recv_multipart(), 5)

            status, rid, out = await ask(b"health", b"h1", b"")
            assert (status, rid) == (b"200", b"h1")
            assert msgspec.msgpack.decode(out)["max_batch"] == 4

            req = msgspec.msgpack.encode(json.loads(body(2, "z1")))
            status, rid, out = await ask(b"score", b"z1", req)
            assert (status, rid) == (b"200", b"z1")
            assert [r["reward"] for r in msgspec.msgpack.decode(out)["rewards"]] == [0.0, 1.0]

            status, _, out = await ask(b"score", b"z2", b"\xc1garbage")
            assert status == b"400" and "malformed" in msgspec.msgpack.decode(out)["error"]
            status, _, out = await ask(b"frobnicate", b"z3", b"")
            assert status == b"400" and "unknown method" in msgspec.msgpack.decode(out)["error"]
            status, _, out = await ask(b"score", b"z4")
            assert status == b"400" and "expected 3 frames" in msgspec.msgpack.decode(out)["error"]
        finally:
            sock.close(0)
            ctx.term()


def test_load_function_uses_importlib_and_explains_failures():
    assert load_function("tests.reward.reward_fns:length_reward").__name__ == "length_reward"
    for target, needle in [
        ("no_colon", "expected package.module:function"),
        ("tests.reward.does_not_exist:fn", "cannot import module"),
        ("tests.reward.reward_fns:missing", "no attribute 'missing'"),
        ("tests.reward.reward_fns:NOT_CALLABLE", "is a int, not callable"),
        ("__import__('os').system('true'):x", "cannot import module"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            load_function(target)

"""Services written from the minimal reply schema `{"version": 1, "rewards": [{"id",
"reward"}]}`, without `request_id` (issue 13 item 4): accepted over HTTP and ZeroMQ, in a
client call and in a whole run; a `request_id` that is present is still checked."""

from __future__ import annotations

import asyncio
import json
import random

import msgspec
import pytest
import torch
from aiohttp import web
from reward_thirdparty import RawZmqService, StdlibHttpService

from hybridflow.bench.reward import BENCH_DEFAULTS, _topology
from hybridflow.config.schema import load_topology
from hybridflow.errors import RewardProtocolError
from hybridflow.pipeline.runtime.runner import run_topology
from hybridflow.reward import ClientConfig, make_client
from hybridflow.reward.schema import Item, ScoreRequest, decode_reply

FAST = {"timeout_s": 2.0, "retries": 0}


def minimal(req: dict) -> dict:
    """The reply exactly as the minimal schema writes it: no request_id, no info."""
    return {
        "version": 1,
        "rewards": [{"id": it["id"], "reward": len(it["response_ids"])} for it in req["items"]],
    }


def items(n: int) -> list[Item]:
    return [Item(id=f"0-0-{i}", response_ids=list(range(i))) for i in range(n)]


async def score(protocol: str, address: str, n: int = 5) -> list[float]:
    c = make_client(protocol, address, ClientConfig(max_batch=2, **FAST), rng=random.Random(0))
    try:
        return (await c.score(items(n))).rewards
    finally:
        await c.aclose()


@pytest.fixture
async def aiohttp_minimal():
    """A reward service as someone would write it from the schema alone, on aiohttp."""

    async def handle(request: web.Request) -> web.Response:
        req = await request.json()
        if req.get("version") != 1:
            return web.json_response({"version": 1, "error": "bad version"}, status=400)
        return web.json_response(minimal(req))

    app = web.Application()
    app.router.add_post("/score", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}/score"
    await runner.cleanup()


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
@pytest.mark.parametrize("request_id", ["absent", None])
def test_reply_without_request_id_decodes(encoding, request_id):
    req = ScoreRequest(version=1, request_id="n.1-0-0-0", items=items(2))
    reply = minimal({"items": [{"id": i.id, "response_ids": i.response_ids} for i in req.items]})
    if request_id is None:
        reply["request_id"] = None  # an explicit null reads as absent
    enc = msgspec.json.encode if encoding == "json" else msgspec.msgpack.encode
    out = decode_reply(enc(reply), encoding, req, service="s", max_body_bytes=1 << 20)
    assert {k: v.reward for k, v in out.items()} == {"0-0-0": 0.0, "0-0-1": 1.0}


def test_a_present_request_id_is_still_checked():
    req = ScoreRequest(version=1, request_id="n.1-0-0-0", items=items(1))
    for wrong in ("other", ""):
        data = json.dumps(
            {"version": 1, "request_id": wrong, "rewards": [{"id": "0-0-0", "reward": 0}]}
        )
        with pytest.raises(RewardProtocolError, match="reply is for request_id"):
            decode_reply(data.encode(), "json", req, service="s", max_body_bytes=1 << 20)


async def test_aiohttp_service_from_the_minimal_schema(aiohttp_minimal):
    assert await score("http", aiohttp_minimal) == [0.0, 1.0, 2.0, 3.0, 4.0]


async def test_stdlib_http_service_without_request_id():
    svc = StdlibHttpService(lambda req, attempt: (200, json.dumps(minimal(req)).encode(), 0.0))
    try:
        assert await score("http", svc.url) == [0.0, 1.0, 2.0, 3.0, 4.0]
    finally:
        await asyncio.to_thread(svc.close)


async def test_zmq_service_without_request_id_in_the_body():
    """ZeroMQ routes replies by the request_id *frame*; the body may leave it out."""
    svc = RawZmqService(lambda req, attempt: (200, json.dumps(minimal(req)).encode(), 0.0))
    try:
        assert await score("zmq", svc.endpoint) == [0.0, 1.0, 2.0, 3.0, 4.0]
    finally:
        await asyncio.to_thread(svc.close)


async def test_a_run_scores_through_a_minimal_aiohttp_service(
    aiohttp_minimal, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # runs/<name>/ goes here
    knobs = {**BENCH_DEFAULTS, "protocol": "http", "rollout_ms_per_sample": 0.0}
    data = _topology({**knobs, "train_ms_per_sample": 0.0}, aiohttp_minimal, "streamed", quick=True)
    data["run"].update({"steps": 1, "step_batch": 16, "micro_batch": 8})
    data["stages"]["reward"]["roles"]["reward"]["options"]["max_batch"] = 3
    topo = load_topology(data)
    res = await asyncio.to_thread(run_topology, topo, collect=("response_ids", "rewards"))
    got = res.collected[0]
    rewards = torch.cat(got["rewards"])
    assert rewards.shape == (16,) and res.metrics[0]["reward/service_requests"] == 6.0
    assert torch.isfinite(rewards).all()

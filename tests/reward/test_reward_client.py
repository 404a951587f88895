"""The client against real local services: the SDK's own servers, and misbehaving
third-party ones on http.server / raw pyzmq (reward_thirdparty.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from reward_thirdparty import RawZmqService, StdlibHttpService, good_reply, ok

from hybridflow.errors import ConfigError, RewardProtocolError, RewardServiceError
from hybridflow.reward import ClientConfig, FallbackPolicy, make_client, start_server
from hybridflow.reward.schema import Item

FAST = {"timeout_s": 0.5, "retries": 2, "backoff_s": 0.02, "backoff_max_s": 0.05}


def items(n: int, step: int = 0) -> list[Item]:
    return [Item(id=f"{step}-0-{i}", response_ids=list(range(i))) for i in range(n)]


def client(protocol, address, **kw):
    return make_client(protocol, address, ClientConfig(**{**FAST, **kw}), rng=random.Random(0))


def length_fn(prompts, responses, prompt_ids, response_ids, metadata):
    return [float(len(r)) for r in response_ids]


@pytest.fixture
async def http_service():
    services = []

    def make(behave=ok):
        services.append(StdlibHttpService(behave))
        return services[-1]

    yield make
    for s in services:
        await asyncio.to_thread(s.close)


@pytest.fixture
async def zmq_service():
    services = []

    def make(behave=ok, frames=None):
        services.append(RawZmqService(behave, frames))
        return services[-1]

    yield make
    for s in services:
        await asyncio.to_thread(s.close)


# ---------------------------------------------------------------------------------------
# happy path, both protocols, against the SDK server


@pytest.mark.parametrize("protocol", ["http", "zmq"])
async def test_happy_path_batches_in_order(protocol):
    async with await start_server(length_fn, protocol, port=0, max_batch=4) as srv:
        c = client(protocol, srv.address, max_batch=3)
        try:
            assert (await c.health())["max_batch"] == 4
            res = await c.score(items(10), step=3, mb_id=1)
        finally:
            await c.aclose()
    assert res.rewards == [float(i) for i in range(10)]
    assert (res.failures, res.retries, res.requests) == (0, 0, 4)  # ceil(10 / 3) requests
    assert srv.core.calls == 4 and len(res.latencies_ms) == 4


# ---------------------------------------------------------------------------------------
# slow service: timeouts, retries, eventual success without duplicates


async def test_slow_thirdparty_http_retries_same_request_id_and_counts_once(http_service):
    def slow_first(req, attempt):  # first attempt of every request is too slow
        return 200, json.dumps(good_reply(req)).encode(), 0.6 if attempt == 1 else 0.0

    svc = http_service(slow_first)
    c = client("http", svc.url, max_batch=2, timeout_s=0.3)
    try:
        res = await c.score(items(5))
    finally:
        await c.aclose()
    assert res.rewards == [0.0, 1.0, 2.0, 3.0, 4.0]  # each id exactly once, in order
    assert res.retries == 3 and res.requests == 6  # 3 requests, each tried twice
    assert sorted(svc.attempts.values()) == [2, 2, 2]
    for rid in svc.attempts:  # a retry carries the same request_id and the same ids
        sent = [[it["id"] for it in r["items"]] for r in svc.requests if r["request_id"] == rid]
        assert sent[0] == sent[1]


async def test_slow_thirdparty_zmq_late_replies_are_dropped(zmq_service):
    def slow_first(req, attempt):
        return 200, json.dumps(good_reply(req)).encode(), 0.4 if attempt == 1 else 0.0

    svc = zmq_service(slow_first)  # answers one at a time: the late reply arrives too
    c = client("zmq", svc.endpoint, max_batch=10, timeout_s=0.25, retries=3)
    try:
        res = await c.score(items(4))
    finally:
        await c.aclose()
    assert res.rewards == [0.0, 1.0, 2.0, 3.0]
    assert res.retries >= 1 and res.failures == 0


@pytest.mark.parametrize("protocol", ["http", "zmq"])
async def test_sdk_server_runs_a_retried_request_once(protocol):
    calls = []

    async def slow(prompts, responses, prompt_ids, response_ids, metadata):
        calls.append(len(prompts))
        await asyncio.sleep(0.5)
        return [1.0] * len(prompts)

    async with await start_server(slow, protocol, port=0) as srv:
        c = client(protocol, srv.address, timeout_s=0.2, retries=6, backoff_s=0.05)
        try:
            res = await c.score(items(3))
        finally:
            await c.aclose()
    assert res.rewards == [1.0, 1.0, 1.0] and res.retries >= 1
    assert calls == [3]  # retries joined the running call / hit the cache


# ---------------------------------------------------------------------------------------
# status codes: 5xx/429 retried, other 4xx not


async def test_5xx_then_success_and_4xx_fails_at_once(http_service):
    def flaky(req, attempt):
        if attempt <= 2:
            return 503, b'{"version": 1, "error": "warming up"}', 0.0
        return ok(req, attempt)

    svc = http_service(flaky)
    c = client("http", svc.url)
    try:
        res = await c.score(items(2))
    finally:
        await c.aclose()
    assert res.rewards == [0.0, 1.0] and res.retries == 2

    svc = http_service(lambda req, a: (422, b'{"version": 1, "error": "no such task"}', 0.0))
    c = client("http", svc.url, on_failure=FallbackPolicy(fallback=0.0))
    with pytest.raises(RewardServiceError, match="status 422: no such task") as info:
        await c.score(items(2))
    await c.aclose()
    assert info.value.status == "422" and info.value.sample_ids == ("0-0-0", "0-0-1")
    assert sum(svc.attempts.values()) == 1  # a 4xx is not retried, not even under fallback


async def test_retries_exhausted_fail_names_service_status_and_ids(http_service):
    svc = http_service(lambda req, a: (500, b'{"version": 1, "error": "judge crashed"}', 0.0))
    c = client("http", svc.url, retries=2)
    with pytest.raises(RewardServiceError) as info:
        await c.score(items(3, step=7))
    await c.aclose()
    msg = str(info.value)
    assert svc.url in msg and "failed after 3 attempts" in msg and "judge crashed" in msg
    assert "7-0-0, 7-0-1, 7-0-2" in msg and info.value.status == "500"
    assert sum(svc.attempts.values()) == 3


# ---------------------------------------------------------------------------------------
# protocol violations: errors under every policy, never zeros, never retried

GARBAGE = [
    ("garbage", lambda req: (200, b"<html>oops</html>")),
    (
        "wrong length",
        lambda req: (
            200,
            json.dumps({**good_reply(req), "rewards": good_reply(req)["rewards"][:-1]}).encode(),
        ),
    ),
    ("NaN", lambda req: (200, json.dumps(good_reply(req, lambda it: float("nan"))).encode())),
    ("string reward", lambda req: (200, json.dumps(good_reply(req, lambda it: "0.5")).encode())),
    ("wrong version", lambda req: (200, json.dumps({**good_reply(req), "version": 9}).encode())),
]


@pytest.mark.parametrize(("case", "make"), GARBAGE, ids=[g[0] for g in GARBAGE])
@pytest.mark.parametrize("protocol", ["http", "zmq"])
async def test_protocol_violations_raise_even_with_fallback(
    protocol, case, make, http_service, zmq_service
):
    def behave(req, attempt):
        status, body = make(req)
        if protocol == "zmq" and case == "garbage":
            body = b"RAW:" + body
        return status, body, 0.0

    svc = http_service(behave) if protocol == "http" else zmq_service(behave)
    address = svc.url if protocol == "http" else svc.endpoint
    c = client(protocol, address, on_failure=FallbackPolicy(fallback=-1.0))
    with pytest.raises(RewardProtocolError) as info:
        await c.score(items(3))
    await c.aclose()
    assert address in str(info.value) and info.value.sample_ids == ("0-0-0", "0-0-1", "0-0-2")
    assert sum(svc.attempts.values()) == 1


async def test_oversize_reply_is_a_protocol_error(http_service):
    big = json.dumps({"version": 1, "request_id": "x", "rewards": [], "pad": "x" * 5000}).encode()
    svc = http_service(lambda req, a: (200, big, 0.0))
    c = client("http", svc.url, max_body_bytes=4096)
    with pytest.raises(RewardProtocolError, match="exceeds max_body_bytes=4096"):
        await c.score(items(1))
    await c.aclose()


async def test_zmq_malformed_frames_are_a_protocol_error(zmq_service):
    svc = zmq_service(frames=lambda reply: [b"OK!", *reply[1:]])
    c = client("zmq", svc.endpoint)
    with pytest.raises(RewardProtocolError, match="is not a code"):
        await c.score(items(1))
    await c.aclose()


# ---------------------------------------------------------------------------------------
# server down at start: error or fallback, per policy


@pytest.mark.parametrize("protocol", ["http", "zmq"])
async def test_service_down_fail_and_fallback(protocol, caplog, unused_tcp_port):
    address = (
        f"http://127.0.0.1:{unused_tcp_port}/score"
        if protocol == "http"
        else f"tcp://127.0.0.1:{unused_tcp_port}"
    )
    c = client(protocol, address, timeout_s=0.2, retries=1)
    with pytest.raises(RewardServiceError) as info:
        await c.score(items(2))
    await c.aclose()
    assert info.value.status == "unreachable" and address in str(info.value)
    assert "failed after 2 attempts" in str(info.value) and "0-0-0, 0-0-1" in str(info.value)

    c = client(
        protocol, address, timeout_s=0.2, retries=1, on_failure=FallbackPolicy(fallback=-1.0)
    )
    with caplog.at_level(logging.WARNING, logger="hybridflow.reward.client"):
        res = await c.score(items(2))
    await c.aclose()
    assert res.rewards == [-1.0, -1.0] and res.failures == 2 and res.retries == 1
    assert "2 samples get fallback reward -1.0" in caplog.text


# ---------------------------------------------------------------------------------------
# the concurrency bound, counted by the servers


async def test_concurrency_bound_thirdparty_http(http_service):
    svc = http_service(lambda req, a: (*ok(req, a)[:2], 0.15))
    c = client("http", svc.url, max_batch=1, max_concurrency=3, timeout_s=5)
    try:
        res = await c.score(items(12))
    finally:
        await c.aclose()
    assert res.rewards == [float(i) for i in range(12)]
    assert svc.max_in_flight == 3  # reached, never exceeded


@pytest.mark.parametrize("protocol", ["http", "zmq"])
async def test_concurrency_bound_sdk_server(protocol):
    state = {"now": 0, "max": 0}

    async def counting(prompts, responses, prompt_ids, response_ids, metadata):
        state["now"] += 1
        state["max"] = max(state["max"], state["now"])
        await asyncio.sleep(0.05)
        state["now"] -= 1
        return [0.5] * len(prompts)

    async with await start_server(counting, protocol, port=0, concurrency=16) as srv:
        c = client(protocol, srv.address, max_batch=2, max_concurrency=4, timeout_s=5)
        try:
            res = await c.score(items(30))
        finally:
            await c.aclose()
    assert res.rewards == [0.5] * 30 and state["max"] == 4


# ---------------------------------------------------------------------------------------
# bearer token and config errors


async def test_bearer_token(monkeypatch):
    monkeypatch.setenv("REWARD_TOKEN_TEST", "s3cret")
    async with await start_server(length_fn, "http", port=0, token="s3cret") as srv:
        c = client("http", srv.address, token_env="REWARD_TOKEN_TEST")
        try:
            assert (await c.score(items(2))).rewards == [0.0, 1.0]
        finally:
            await c.aclose()
        monkeypatch.setenv("REWARD_TOKEN_TEST", "wrong")
        c = client("http", srv.address, token_env="REWARD_TOKEN_TEST")
        with pytest.raises(RewardServiceError, match="status 401: missing or wrong bearer token"):
            await c.score(items(2))
        await c.aclose()
    monkeypatch.delenv("REWARD_TOKEN_TEST")
    with pytest.raises(ConfigError, match="token_env: environment variable 'REWARD_TOKEN_TEST'"):
        client("http", srv.address, token_env="REWARD_TOKEN_TEST")


def test_config_errors():
    with pytest.raises(ConfigError, match="url: expected http"):
        make_client("http", "tcp://127.0.0.1:1", ClientConfig())
    with pytest.raises(ConfigError, match="token_env: applies to http"):
        make_client("zmq", "tcp://127.0.0.1:1", ClientConfig(token_env="X"))
    with pytest.raises(ConfigError, match=r"opts\.fallback: must be a finite"):
        FallbackPolicy(fallback=float("nan")).validate("opts")
    with pytest.raises(ConfigError, match=r"o\.max_concurrency: must be >= 1, got 0"):
        ClientConfig(max_concurrency=0).validate("o")


class _Redirector:
    """An HTTP server answering every POST with 307 to `target` (an open redirect)."""

    def __init__(self, target: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(307)
                self.send_header("Location", target)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


async def test_redirect_is_not_followed_unless_configured(http_service):
    target = http_service()
    redirector = _Redirector(target.url)
    try:
        c = client("http", redirector.url, on_failure=FallbackPolicy(fallback=0.0))
        with pytest.raises(RewardServiceError) as info:
            await c.score(items(2))
        await c.aclose()
        text = str(info.value)
        assert info.value.status == "307" and redirector.url in text
        assert f"a redirect to {target.url!r}, which is not followed" in text
        assert "follow_redirects: true" in text
        assert not target.requests  # the samples never reached the other address

        c = client("http", redirector.url, follow_redirects=True)
        res = await c.score(items(2))
        await c.aclose()
        assert res.rewards == [0.0, 1.0] and len(target.requests) == 1
    finally:
        await asyncio.to_thread(redirector.close)


def test_follow_redirects_is_an_http_option():
    with pytest.raises(ConfigError, match="follow_redirects: applies to http services only"):
        client("zmq", "tcp://127.0.0.1:5555", follow_redirects=True)

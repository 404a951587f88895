"""The environment service over real loopback sockets (HTTP and ZeroMQ): a served game,
and faults (a lost reply, a slow step, 5xx, a malformed reply, an environment that
raises, an expired session). Each gives the reply, a named error or a counted fallback;
no step is ever applied twice; nothing hangs (every call has a small timeout here)."""

from __future__ import annotations

import asyncio

import pytest
from env_service_helpers import serve_faulty

from hybridflow.errors import ConfigError, EnvProtocolError, EnvServiceError
from hybridflow.stages.env.protocol import Action, ObservationKind
from hybridflow.stages.env.registry import make_env_factory
from hybridflow.stages.env.service.client import _SHARED, RemoteEnv
from hybridflow.stages.env.service.server import start_env_server

PROTOCOLS = ["http", "zmq"]
# Timeouts small enough to keep the lost-reply tests short, large enough that a loaded CI
# machine answers a normal call within them (0.3 s was not: flaky at load 8).
FAST = {"timeout_s": 1.0, "retries": 2, "backoff_s": 0.01}


def remote(server, **options) -> RemoteEnv:
    return RemoteEnv(url=server.address, **{**FAST, **options})


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_served_game_plays_to_the_end(protocol):
    server = await start_env_server("guess_number", {"max_turns": 7}, protocol, port=0)
    try:
        env = make_env_factory("remote", {"url": server.address, "timeout_s": 5})()
        assert isinstance(env, RemoteEnv)
        obs = await env.reset({"reward_model": {"ground_truth": "37"}, "extra_info": {}})
        assert obs.kind is ObservationKind.EMPTY
        low, high, results = 1, 100, []
        while True:  # binary search, through the service
            guess = (low + high) // 2
            r = await env.step(Action(str(guess)))
            results.append(r)
            if r.done:
                break
            text = r.observation.messages[0]["content"]
            low, high = (guess + 1, high) if text.startswith("Higher") else (low, guess - 1)
        assert r.reward == 1.0 and r.info["won"] == 1 and guess == 37
        assert all(x.info["service_retries"] == 0 for x in results)
        await env.close()
        assert server.core.applied == {"reset": 1, "step": len(results), "close": 1}
        assert server.core.sessions == {} and _SHARED.open_transports() == 0
    finally:
        await server.aclose()


async def test_tools_declared_at_reset_reach_the_client():
    server = await start_env_server("calculator", {}, "http", port=0)
    try:
        env = remote(server, timeout_s=30)  # the first CalculatorEnv imports transformers
        await env.reset({"reward_model": {"ground_truth": "3"}})
        assert [t["function"]["name"] for t in env.tools_schema()] == ["calc"]
        await env.close()
    finally:
        await server.aclose()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_lost_reply_is_retried_and_the_step_is_applied_once(protocol):
    server, core = await serve_faulty(protocol, {"step 0": ["lose"]})
    try:
        env = remote(server)
        await env.reset({"turns": 2})
        r = await env.step(Action("first"))
        assert not r.done and r.observation.messages[0]["content"] == "ok 1"
        # the lost attempt and at least one retry; applied once whatever the retries
        assert core.seen["step 0"] >= 2 and core.app.applied["step"] == 1
        assert r.info["service_retries"] == core.seen["step 0"] - 1 >= 1
        r = await env.step(Action("second"))
        assert r.done and r.reward == 2.0 and r.info["echo"] == "second"
        await env.close()
    finally:
        await server.aclose()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_slow_step_times_out_and_the_retry_gets_the_running_calls_reply(protocol):
    server, core = await serve_faulty(protocol, env_options={"delay_s": 0.5})
    try:
        env = remote(server, timeout_s=0.2, retries=30)  # retries: a loaded machine's slack
        await env.reset({"turns": 1})
        r = await env.step(Action("slow"))
        assert r.done and r.reward == 1.0
        assert core.seen["step 0"] >= 2 and core.app.applied["step"] == 1
        await env.close()
    finally:
        await server.aclose()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_5xx_is_retried_then_named_after_the_last_retry(protocol):
    server, core = await serve_faulty(protocol, {"step 0": ["503", "503"], "step 1": ["503"] * 9})
    try:
        env = remote(server)
        await env.reset({"turns": 3})
        r = await env.step(Action("a"))  # two 503s, then the reply
        assert r.info["service_retries"] == 2 and core.app.applied["step"] == 1
        with pytest.raises(EnvServiceError) as exc:
            await env.step(Action("b"))
        text = str(exc.value)
        assert server.address in text and env.session_id in text and "step 1" in text
        assert "3 attempts" in text and "env_options.timeout_s=1 s" in text
        assert "status 503: scripted overload" in text and exc.value.status == "503"
        assert core.seen["step 1"] == 3 and core.app.applied["step"] == 1
        await env.close()
    finally:
        await server.aclose()


async def test_an_outage_under_the_fallback_policy_ends_the_trajectory_counted():
    server, _ = await serve_faulty("http", {"step 0": ["503"] * 9, "reset": ["503"] * 9})
    try:
        fallback = {"on_failure": {"fallback": -1.0}, "retries": 1}
        env = remote(server, **fallback)  # the reset fails: the dataset's prompt, then the end
        assert (await env.reset({"turns": 2})).kind is ObservationKind.EMPTY
        r = await env.step(Action("x"))
        assert r.done and r.reward == -1.0 and r.info["service_failures"] == 1
        await env.close()
    finally:
        await server.aclose()
    server, core = await serve_faulty("http", {"step 0": ["503"] * 9})
    try:
        env = remote(server, **fallback)
        await env.reset({"turns": 2})
        r = await env.step(Action("x"))
        assert r.done and r.reward == -1.0 and r.info["service_failures"] == 1
        assert core.app.applied["step"] == 0
        await env.close()
    finally:
        await server.aclose()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("fault", ["garbage", "wrong-step"])
async def test_a_malformed_reply_is_a_protocol_error_never_retried(protocol, fault):
    server, core = await serve_faulty(protocol, {"step 0": [fault]})
    try:
        env = remote(server, on_failure={"fallback": 0.0})  # not for protocol errors
        await env.reset({"turns": 2})
        with pytest.raises(EnvProtocolError, match=r"broke the protocol on step 0 of session"):
            await env.step(Action("x"))
        assert core.seen["step 0"] == 1
        await env.close()
    finally:
        await server.aclose()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_environment_that_raises_fails_its_session_at_once(protocol):
    server, core = await serve_faulty(protocol, env_options={"fail_at": 1})
    try:
        env = remote(server)
        await env.reset({"turns": 2})
        with pytest.raises(EnvServiceError, match=r"scripted failure at turn 1") as exc:
            await env.step(Action("x"))
        assert exc.value.status == "500" and core.seen["step 0"] == 1  # not retried
        env._next_step = 0
        with pytest.raises(EnvServiceError, match=r"scripted failure"):
            await env.step(Action("x"))
        assert core.app.applied["step"] == 1
        await env.close()
    finally:
        await server.aclose()


async def test_an_idle_session_expires_and_is_named():
    server, core = await serve_faulty("http", session_ttl_s=0.2)
    try:
        env = remote(server)
        await env.reset({"turns": 3})
        await asyncio.sleep(0.3)
        other = remote(server)
        await other.reset({"turns": 3})  # any request closes the idle ones
        with pytest.raises(EnvServiceError, match=r"status 404: unknown session .*--session-ttl-s"):
            await env.step(Action("late"))
        assert core.app.applied["close"] == 1
        await env.close()
        await other.close()
    finally:
        await server.aclose()


def test_remote_options_are_checked_by_name_when_the_factory_is_built():
    path = "stages.rollout.options"
    cases = [
        ({"url": "ftp://x"}, "env_options.url"),
        ({"url": "http://h:1/env", "timeout_s": 0}, "env_options.timeout_s"),
        ({"url": "tcp://h:1", "token_env": "T"}, "env_options.token_env"),
        ({"url": "http://h:1/env", "on_failure": {"fallback": "x"}}, "env_options.on_failure"),
        ({"url": "http://h:1/env", "retry": 2}, "env_options"),
    ]
    for options, key in cases:
        with pytest.raises(ConfigError) as exc:
            make_env_factory("remote", options, path)
        assert exc.value.path == f"{path}.{key}", options
    assert RemoteEnv(url="tcp://h:1", retries=1, timeout_s=2, backoff_s=0.5).opts.budget_s() == 4.5


async def test_the_http_bearer_token_is_required_when_set(monkeypatch):
    server = await start_env_server("guess_number", {}, "http", port=0, token="s3cret")
    try:
        anonymous = remote(server)
        with pytest.raises(EnvServiceError, match=r"status 401: missing or wrong bearer token"):
            await anonymous.reset({})  # 401 is not retried
        await anonymous.close()  # the loop closes every environment it built, reset or not
        monkeypatch.setenv("ENV_TOKEN_FOR_TEST", "s3cret")
        env = remote(server, token_env="ENV_TOKEN_FOR_TEST")
        await env.reset({"reward_model": {"ground_truth": "5"}})
        await env.close()
        assert server.core.applied["reset"] == 1
    finally:
        await server.aclose()

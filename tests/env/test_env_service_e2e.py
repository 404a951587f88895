"""`hybridflow env-serve` as a real subprocess (a kill -9 becomes a named error or the
fallback, in bounded time), the documented wire format as raw JSON, and the trajectory
loop of the rollout stage driving a served environment through `env: remote`."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from env_helpers import chatml_tokenizer

from hybridflow.errors import EnvServiceError
from hybridflow.stages.env.protocol import Action
from hybridflow.stages.env.service.client import RemoteEnv
from hybridflow.stages.env.service.server import start_env_server
from hybridflow.stages.rollout.multiturn import MultiTurnConfig, TrajectoryLoop, TurnOutput

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FAST = {"timeout_s": 0.5, "retries": 1, "backoff_s": 0.02}


async def start_cli(protocol: str, *extra: str):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "hybridflow",
        "env-serve",
        "env_service_helpers:CountingEnv",  # from the working directory, as `python -m` would
        "--protocol",
        protocol,
        "--port",
        "0",
        *extra,
        cwd=HERE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    lines = []
    try:
        async with asyncio.timeout(60):
            while True:
                line = (await proc.stdout.readline()).decode()
                if not line:
                    raise AssertionError(f"env-serve exited early: {''.join(lines)}")
                lines.append(line)
                if "listening on " in line:
                    return proc, line.split("listening on ", 1)[1].strip()
    except BaseException:
        proc.kill()
        await proc.wait()
        raise


async def stop(proc) -> None:
    if proc.returncode is None:
        proc.kill()
    await proc.wait()
    await proc.stdout.read()


@pytest.mark.parametrize("protocol", ["http", "zmq"])
async def test_a_killed_service_is_a_named_error_or_the_fallback(protocol):
    proc, address = await start_cli(protocol, "--options", '{"delay_s": 0.0}')
    try:
        env = RemoteEnv(url=address, **FAST)
        spare = RemoteEnv(url=address, on_failure={"fallback": 0.5}, **FAST)
        await env.reset({"turns": 3})
        await spare.reset({"turns": 3})
        assert (await env.step(Action("a"))).observation.messages[0]["content"] == "ok 1"
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        async with asyncio.timeout(20):  # 2 attempts x 0.5 s and a backoff, not a hang
            with pytest.raises(EnvServiceError, match=r"step 1 of session .* 2 attempts") as exc:
                await env.step(Action("b"))
            r = await spare.step(Action("b"))
            await env.close()  # best effort: logged, not raised
            await spare.close()
        assert address in str(exc.value) and exc.value.call == "step 1"
        assert r.done and r.reward == 0.5 and r.info["service_failures"] == 1
    finally:
        await stop(proc)


async def test_bad_options_exit_2_with_the_key():
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "hybridflow",
        "env-serve",
        "env_service_helpers:CountingEnv",
        "--options",
        '{"dealy_s": 1}',
        cwd=HERE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and b"env_options.dealy_s" in err and b"delay_s" in err


async def test_the_documented_json_calls():
    """The bodies docs/env-service.md shows with curl, posted as raw JSON."""
    server = await start_env_server("guess_number", {}, "http", port=0)
    url = server.address
    try:
        async with aiohttp.ClientSession() as http:

            async def post(body):
                async with http.post(url, data=json.dumps(body)) as resp:
                    return resp.status, json.loads(await resp.read())

            record = {"reward_model": {"ground_truth": "42"}, "extra_info": {"max_turns": 3}}
            reset = {"version": 1, "call": "reset", "session_id": "s1", "record": record}
            status, body = await post(reset)
            assert status == 200 and body == {
                "version": 1,
                "session_id": "s1",
                "observation": {},
                "tools": [],
            }
            step = {
                "version": 1,
                "call": "step",
                "session_id": "s1",
                "step_id": 0,
                "action": {"text": "50"},
            }
            status, body = await post(step)
            assert status == 200 and body["step_id"] == 0 and body["done"] is False
            assert body["observation"]["messages"][0]["content"].startswith("Lower")
            assert await post(step) == (status, body)  # a retry: the same reply
            status, body = await post({**step, "step_id": 2})
            assert status == 409 and "expects step_id 1" in body["error"]
            assert body["retryable"] is False and body["request_id"] == "s1/step/2"
            assert body["version"] == 1
            status, body = await post({**step, "session_id": "nope"})
            assert status == 404 and "unknown session" in body["error"]
            status, body = await post({"version": 2, "call": "close", "session_id": "s1"})
            assert status == 400 and "unsupported version 2" in body["error"]
            assert await post({"version": 1, "call": "close", "session_id": "s1"}) == (
                200,
                {"version": 1, "session_id": "s1", "closed": True},
            )
            async with http.get(url.replace("/env", "/health")) as resp:
                health = json.loads(await resp.read())
            assert health == {
                "version": 1,
                "status": "ok",
                "env": "guess_number",
                "sessions": 0,
                "max_sessions": 1024,
            }
    finally:
        await server.aclose()


class EchoEngine:
    """A TurnEngine answering every request with [7, 8, eos] (log-prob -0.5 each)."""

    def __init__(self, eos: int) -> None:
        self.eos = eos

    async def generate(self, requests, turn):
        return [TurnOutput([7, 8, self.eos], [-0.5] * 3, True) for _ in requests]


@pytest.mark.parametrize("protocol", ["http", "zmq"])
async def test_the_trajectory_loop_drives_a_served_environment(protocol):
    tok = chatml_tokenizer()
    server = await start_env_server("env_service_helpers:CountingEnv", {}, protocol, port=0)
    try:
        cfg = MultiTurnConfig(
            env="remote",
            env_options={"url": server.address, "timeout_s": 5.0},
            max_turns=4,
            max_total_tokens=0,
            env_timeout_s=30.0,
            env_concurrency=8,
            tool_parser="",
        )
        end = tok.convert_tokens_to_ids("<|im_end|>")
        loop = TrajectoryLoop(cfg, tok, [end], position_limit=512, path="opts")
        prompt = tok.encode("Ann has 7 apples.", add_special_tokens=False)
        records = [{"turns": t} for t in (1, 3, 2)]
        result = await loop.run(EchoEngine(end), [prompt] * 3, records, 8)
        assert [lay.num_turns for lay in result.layouts] == [1, 3, 2]
        assert result.env_reward == [1.0, 3.0, 2.0]
        assert result.metrics["env/service_retries"] == 0.0
        assert server.core.applied == {"reset": 3, "step": 6, "close": 3}
        assert server.core.sessions == {}
    finally:
        await server.aclose()

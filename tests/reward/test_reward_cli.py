"""`python -m hybridflow reward-serve module:function` as a real subprocess: it answers a
real request, a kill -9 mid-run becomes a clear error (or the fallback), and SIGTERM
lets the request in flight finish before a clean exit."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from hybridflow.errors import RewardServiceError
from hybridflow.reward import ClientConfig, FallbackPolicy, make_client
from hybridflow.reward.schema import Item

ROOT = Path(__file__).resolve().parents[2]
FAST = {"timeout_s": 0.5, "retries": 1, "backoff_s": 0.02}


async def start_cli(function: str, protocol: str):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "hybridflow",
        "reward-serve",
        f"tests.reward.reward_fns:{function}",
        "--protocol",
        protocol,
        "--port",
        "0",
        "--max-batch",
        "8",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    lines = []
    try:
        async with asyncio.timeout(30):
            while True:
                line = (await proc.stdout.readline()).decode()
                if not line:
                    raise AssertionError(f"reward-serve exited early: {''.join(lines)}")
                lines.append(line)
                if "listening on " in line:
                    return proc, line.split("listening on ", 1)[1].strip()
    except BaseException:
        proc.kill()
        await proc.wait()
        raise


async def stop(proc) -> int:
    if proc.returncode is None:
        proc.kill()
    rc = await proc.wait()
    await proc.stdout.read()
    return rc


@pytest.mark.parametrize("protocol", ["http", "zmq"])
async def test_cli_serves_then_kill9_is_an_error_or_fallback(protocol):
    proc, address = await start_cli("length_reward", protocol)
    items = [Item(id=f"0-0-{i}", response_ids=[1] * i, metadata={"bonus": 0.5}) for i in range(3)]
    try:
        c = make_client(protocol, address, ClientConfig(**FAST))
        try:
            assert (await c.score(items)).rewards == [0.5, 1.5, 2.5]
            proc.send_signal(signal.SIGKILL)  # killed mid-run
            await proc.wait()
            with pytest.raises(RewardServiceError) as info:
                await c.score(items, step=1)
        finally:
            await c.aclose()
        assert address in str(info.value) and info.value.sample_ids == ("0-0-0", "0-0-1", "0-0-2")

        cfg = ClientConfig(**FAST, on_failure=FallbackPolicy(fallback=0.25))
        c = make_client(protocol, address, cfg)
        try:
            res = await c.score(items, step=2)
        finally:
            await c.aclose()
        assert res.rewards == [0.25] * 3 and res.failures == 3
    finally:
        await stop(proc)


async def test_cli_sigterm_finishes_the_request_in_flight(tmp_path):
    proc, address = await start_cli("slow_length_reward", "http")
    started = tmp_path / "started"
    items = [Item(id="a", response_ids=[1, 2], metadata={"touch": str(started), "sleep_s": 1.0})]
    c = make_client("http", address, ClientConfig(timeout_s=20, retries=0))
    try:
        pending = asyncio.create_task(c.score(items))
        async with asyncio.timeout(20):
            while not started.exists():
                await asyncio.sleep(0.02)
        os.kill(proc.pid, signal.SIGTERM)
        assert (await pending).rewards == [2.0]
        async with asyncio.timeout(20):
            assert await proc.wait() == 0
    finally:
        await c.aclose()
        await stop(proc)


@pytest.mark.parametrize("protocol", ["http", "zmq"])
async def test_cli_kill9_with_a_request_in_flight_is_an_error(protocol, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hybridflow.reward")
    proc, address = await start_cli("slow_length_reward", protocol)
    started = tmp_path / "started"
    items = [Item(id="a", response_ids=[1], metadata={"touch": str(started), "sleep_s": 30})]
    # The connection drop fails the request at once (HTTP: reset; ZeroMQ: socket monitor),
    # the retry finds nobody listening.
    c = make_client(protocol, address, ClientConfig(timeout_s=1.5, retries=1, backoff_s=0.01))
    try:
        pending = asyncio.create_task(c.score(items))
        async with asyncio.timeout(20):
            while not started.exists():
                await asyncio.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        with pytest.raises(RewardServiceError, match="failed after 2 attempts") as info:
            await pending
        assert info.value.sample_ids == ("a",) and address in str(info.value)
        lost = "connection lost" if protocol == "zmq" else "ServerDisconnectedError"
        assert lost in caplog.text  # noticed when the connection dropped, not by a timeout
    finally:
        await c.aclose()
        await stop(proc)


async def test_cli_bad_target_exits_2_with_the_reason():
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "hybridflow",
        "reward-serve",
        "tests.reward.reward_fns:nope",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2 and b"no attribute 'nope'" in err

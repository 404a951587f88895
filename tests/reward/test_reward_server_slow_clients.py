"""`reward-serve` against clients that stop halfway, on a real server on 127.0.0.1.

- a client that sends half a body and waits is answered 408 once `body_timeout_s` has
  passed and its connection is closed (before: held as long as the client liked);
- a client that disconnects mid-body is one log line (before: a 27-line traceback each);
- a malformed chunked body mid-way is answered (400 where aiohttp's parser reports it to
  the handler, as its pure-Python parser does; else 408 at the body deadline), no traceback;
- meanwhile the server keeps answering well-behaved clients.
Every wait is bounded, so a regression fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
import pytest

from hybridflow.errors import ConfigError
from hybridflow.reward import start_server
from hybridflow.reward.server import BODY_TIMEOUT_ENV, DEFAULT_BODY_TIMEOUT_S, _body_timeout

BODY = json.dumps({"version": 1, "items": [{"id": "a", "response_ids": [1, 2]}]}).encode()


def ones(prompts, responses, prompt_ids, response_ids, metadata):
    return [1.0 for _ in response_ids]


def head(port: int, length: int) -> bytes:
    return (
        f"POST /score HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def half_sent(port: int) -> tuple[bytes, bool]:
    """Headers and half the body, then wait: (the status line, closed by the server)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head(port, len(BODY)) + BODY[: len(BODY) // 2])
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 10)
        rest = await asyncio.wait_for(reader.read(), 10)  # b"" at EOF: the server hung up
        return status, rest.endswith(b"}")
    finally:
        writer.close()


async def healthy(address: str) -> int:
    async with aiohttp.ClientSession() as s, s.post(address, data=BODY) as r:
        return r.status


def server_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(("hybridflow.reward", "aiohttp"))]


async def test_a_half_sent_body_gets_408_and_is_disconnected_after_body_timeout(caplog):
    caplog.set_level(logging.INFO)
    async with await start_server(ones, "http", port=0, body_timeout_s=0.5) as srv:
        slow = [asyncio.create_task(half_sent(srv.port)) for _ in range(20)]
        await asyncio.sleep(0.1)
        assert await asyncio.wait_for(healthy(srv.address), 10) == 200  # not blocked by them
        # Held one after another, 20 bodies of 0.5 s would still fit 20 s: the bound is
        # liveness, not speed (wall-clock checks belong in bench/).
        answers = await asyncio.wait_for(asyncio.gather(*slow), 20)
    assert all(status.startswith(b"HTTP/1.1 408") for status, _ in answers), answers[0]
    assert all(closed for _, closed in answers)  # a JSON error body, then EOF
    lines = [r.getMessage() for r in server_records(caplog)]
    assert len(lines) == 20 and all("(body_timeout_s); answering 408" in m for m in lines)
    assert f"sent {len(BODY) // 2} bytes of its {len(BODY)}-byte body in 0 s" in lines[0]


async def test_a_client_that_disconnects_mid_body_is_one_log_line(caplog):
    # On the server's own logger too: an earlier test of the session may have set the
    # `hybridflow` logger's level (the CLI does), which a root-only level would not undo.
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="hybridflow.reward.server")
    async with await start_server(ones, "http", port=0) as srv:
        for _ in range(5):
            _, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(head(srv.port, 1000) + b'{"vers')
            await writer.drain()
            await asyncio.sleep(0.05)  # the handler is reading the body
            writer.transport.abort()
        deadline = time.monotonic() + 10
        while len(server_records(caplog)) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert await healthy(srv.address) == 200
    records = server_records(caplog)
    assert [r.getMessage() for r in records] == [
        "client 127.0.0.1 disconnected after 6 bytes of its 1000-byte body"
    ] * 5
    assert not [r for r in records if r.exc_info]  # no traceback


async def test_a_malformed_chunked_body_is_answered_without_a_traceback(caplog):
    caplog.set_level(logging.INFO)
    async with await start_server(ones, "http", port=0, body_timeout_s=0.5) as srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"POST /score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # the handler is reading the body
        writer.write(b"zz\r\n" + BODY + b"\r\n")
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        assert await healthy(srv.address) == 200
    assert status.split()[1] in (b"400", b"408"), status
    assert not [r for r in server_records(caplog) if r.exc_info]


def test_the_cli_body_timeout_comes_from_the_flag_or_the_environment(monkeypatch):
    class Args:
        pass

    monkeypatch.delenv(BODY_TIMEOUT_ENV, raising=False)
    assert _body_timeout(Args()) == DEFAULT_BODY_TIMEOUT_S
    monkeypatch.setenv(BODY_TIMEOUT_ENV, "2.5")
    assert _body_timeout(Args()) == 2.5
    flag = Args()
    flag.body_timeout_s = 4  # a parser with --body-timeout-s wins over the environment
    assert _body_timeout(flag) == 4.0
    for bad in ("soon", "0", "-1", "inf", "nan"):
        monkeypatch.setenv(BODY_TIMEOUT_ENV, bad)
        with pytest.raises(ConfigError, match=BODY_TIMEOUT_ENV):
            _body_timeout(Args())

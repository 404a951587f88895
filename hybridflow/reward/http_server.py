"""HTTP front end of the reward server SDK (aiohttp): routes bytes to a `ServiceCore`.

    POST /  or  POST /score   JSON ScoreRequest -> 200 ScoreReply     (a RewardApp)
    GET  /health              200 Health
    anything else             JSON ErrorReply with the status (400, 401, 404, 405, 409,
                              413, 500)

The environment service (hybridflow/stages/env/service/) serves its own core on other
paths (`paths`, `path`) through this same front end.

Every non-200 answer carries a JSON `{"version": 1, "error": ...}` body, including the
router's own 404/405, so a client never has to parse HTML. Bodies are read with a cap
(`max_body_bytes`), so an oversize request is refused without being buffered whole, and
with a deadline (`body_timeout_s` for the whole body, from the end of its headers): a
client that stops halfway gets 408 and its connection closed, so half-sent bodies cannot
pile up. A client that disconnects mid-body, or sends a malformed one, is one log line
(no traceback: it is the client's fault, and there may be thousands).
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import http_exceptions, web

from hybridflow.reward.app import RewardApp, ServiceCore
from hybridflow.reward.schema import RequestRejected
from hybridflow.reward.transports import read_capped

log = logging.getLogger("hybridflow.reward.server")

JSON = "application/json"


def _error(status: int, message: str) -> web.Response:
    return web.Response(
        status=status, body=RewardApp.error(status, message, "json"), content_type=JSON
    )


async def _answer_and_close(request: web.Request, status: int, message: str) -> web.Response:
    """Send an error answer, then close the connection at once: aiohttp would otherwise
    "linger" up to 10 s reading the rest of a body that is never coming."""
    resp = _error(status, message)
    resp.force_close()
    if request.transport is not None:
        await resp.prepare(request)
        await resp.write_eof()
        request.protocol.force_close()  # the answer is written: close after it flushes
    return resp


async def _read_body(request: web.Request, limit: int, timeout_s: float) -> bytes | web.Response:
    """The body (at most `limit` bytes), or the answer to a client that did not send it."""
    length = request.content_length
    want = f"{length}-byte body" if length is not None else "chunked body"
    try:
        async with asyncio.timeout(timeout_s):
            return await read_capped(request.content, limit)
    except TimeoutError:
        log.warning(
            "client %s sent %d bytes of its %s in %.0f s (body_timeout_s); answering 408",
            request.remote,
            request.content.total_bytes,
            want,
            timeout_s,
        )
        return await _answer_and_close(
            request, 408, f"request body not received within {timeout_s:g} s"
        )
    except ConnectionResetError:
        log.info(
            "client %s disconnected after %d bytes of its %s",
            request.remote,
            request.content.total_bytes,
            want,
        )
        return _error(400, "connection lost mid-body")  # nobody is left to read it
    except http_exceptions.BadHttpMessage as exc:
        log.warning("client %s sent a malformed body: %s", request.remote, exc.message)
        return await _answer_and_close(request, 400, f"malformed request body: {exc.message}")


def build_app(
    core: ServiceCore,
    token: str | None,
    body_timeout_s: float,
    paths: tuple[str, ...] = ("/", "/score"),
) -> web.Application:
    @web.middleware
    async def json_errors(request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException as exc:  # router 404/405 and friends -> JSON bodies
            if exc.status < 400:
                raise
            return _error(exc.status, exc.reason)

    async def score(request: web.Request) -> web.Response:
        if token is not None:
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
                return _error(401, "missing or wrong bearer token")
        length = request.content_length
        if length is not None and length > core.max_body_bytes:
            return _error(413, f"body of {length} bytes exceeds {core.max_body_bytes}")
        body = await _read_body(request, core.max_body_bytes + 1, body_timeout_s)
        if isinstance(body, web.Response):
            return body
        try:
            reply = await core.handle(body, "json")
        except RequestRejected as exc:
            if exc.status >= 500:
                log.warning("answering %d: %s", exc.status, exc.message)
            if exc.body is not None:  # the core's own error reply
                return web.Response(status=exc.status, body=exc.body, content_type=JSON)
            return _error(exc.status, exc.message)
        return web.Response(status=200, body=reply, content_type=JSON)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200, body=core.health("json"), content_type=JSON)

    app = web.Application(middlewares=[json_errors], client_max_size=core.max_body_bytes + 1)
    for path in paths:
        app.router.add_post(path, score)
    app.router.add_get("/health", health)
    return app


class HttpServer:
    """A started aiohttp site; `aclose()` stops accepting and lets running requests finish."""

    def __init__(
        self,
        core: ServiceCore,
        host: str,
        port: int,
        token: str | None,
        grace_s: float,
        body_timeout_s: float,
        *,
        paths: tuple[str, ...] = ("/", "/score"),
        path: str = "/score",
    ):
        if not body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s}")
        self.core, self.host, self.port = core, host, port
        self._token, self._grace_s, self._body_timeout_s = token, grace_s, body_timeout_s
        self._paths, self._path = paths, path
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        self._runner = web.AppRunner(
            build_app(self.core, self._token, self._body_timeout_s, self._paths),
            access_log=None,
            shutdown_timeout=self._grace_s,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the real port when asked for port 0

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}{self._path}"

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

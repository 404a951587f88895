"""HTTP front end of the reward server SDK (aiohttp): routes bytes to a `RewardApp`.

    POST /  or  POST /score   JSON ScoreRequest -> 200 ScoreReply
    GET  /health              200 Health
    anything else             JSON ErrorReply with the status (400, 401, 404, 405, 409,
                              413, 500)

Every non-200 answer carries a JSON `{"version": 1, "error": ...}` body, including the
router's own 404/405, so a client never has to parse HTML. Bodies are read with a cap
(`max_body_bytes`), so an oversize request is refused without being buffered whole.
"""

from __future__ import annotations

import hmac
import logging

from aiohttp import web

from hybridflow.reward.app import RewardApp
from hybridflow.reward.schema import RequestRejected
from hybridflow.reward.transports import read_capped

log = logging.getLogger("hybridflow.reward.server")

JSON = "application/json"


def _error(status: int, message: str) -> web.Response:
    return web.Response(
        status=status, body=RewardApp.error(status, message, "json"), content_type=JSON
    )


def build_app(core: RewardApp, token: str | None = None) -> web.Application:
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
        body = await read_capped(request.content, core.max_body_bytes + 1)
        try:
            reply = await core.score(body, "json")
        except RequestRejected as exc:
            if exc.status >= 500:
                log.warning("answering %d: %s", exc.status, exc.message)
            return _error(exc.status, exc.message)
        return web.Response(status=200, body=reply, content_type=JSON)

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200, body=core.health("json"), content_type=JSON)

    app = web.Application(middlewares=[json_errors], client_max_size=core.max_body_bytes + 1)
    app.router.add_post("/", score)
    app.router.add_post("/score", score)
    app.router.add_get("/health", health)
    return app


class HttpServer:
    """A started aiohttp site; `aclose()` stops accepting and lets running requests finish."""

    def __init__(self, core: RewardApp, host: str, port: int, token: str | None, grace_s: float):
        self.core, self.host, self.port, self._token, self._grace_s = (
            core,
            host,
            port,
            token,
            grace_s,
        )
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        self._runner = web.AppRunner(
            build_app(self.core, self._token), access_log=None, shutdown_timeout=self._grace_s
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the real port when asked for port 0

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}/score"

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

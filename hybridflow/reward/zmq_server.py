"""ZeroMQ front end of the reward server SDK: a ROUTER socket feeding a `ServiceCore`
(a `RewardApp`, whose method frame is b"score"; the environment service's core uses
this front end with its own method frame, b"env").

Frames (schema.py has the layout; the ROUTER adds/strips the peer identity):

    in   [identity, method, request_id, msgpack body]     method: b"score" | b"health"
    out  [identity, status, request_id, msgpack body]     status: b"200", b"400", ...

One task per request, so a slow batch does not hold up health checks or other callers;
the `RewardApp` semaphore bounds concurrent function calls. A message with the wrong
number of frames is answered 400 when it has a request_id frame to answer to, and
dropped (with a warning) when it does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio

from hybridflow.reward.app import RewardApp, ServiceCore
from hybridflow.reward.schema import ZMQ_HEALTH, ZMQ_SCORE, RequestRejected

log = logging.getLogger("hybridflow.reward.server")


class ZmqServer:
    def __init__(
        self,
        core: ServiceCore,
        host: str,
        port: int,
        grace_s: float,
        *,
        method: bytes = ZMQ_SCORE,
    ) -> None:
        self.core, self.host, self.port, self._grace_s = core, host, port, grace_s
        self.method = method
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._loop_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if self.port == 0:
            self.port = self._sock.bind_to_random_port(f"tcp://{self.host}")
        else:
            self._sock.bind(self.address)
        self._loop_task = asyncio.get_running_loop().create_task(
            self._serve(), name=f"reward-zmq-server {self.address}"
        )

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            task = asyncio.get_running_loop().create_task(self._handle(frames))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _handle(self, frames: list[bytes]) -> None:
        assert self._sock is not None
        if len(frames) < 3:
            log.warning("dropping a %d-frame message with no request_id frame", len(frames))
            return
        identity, method, rid = frames[0], frames[1], frames[2]
        status, body, message = 200, b"", ""
        if len(frames) != 4:
            status, message = (
                400,
                f"expected 3 frames (method, request_id, body), got {len(frames) - 1}",
            )
        elif method == ZMQ_HEALTH:
            body = self.core.health("msgpack")
        elif method == self.method:
            try:
                body = await self.core.handle(frames[3], "msgpack")
            except RequestRejected as exc:
                status, message = exc.status, exc.message
                body = exc.body if exc.body is not None else b""
        else:
            status, message = (
                400,
                f"unknown method {method[:32]!r}; expected {self.method!r} or b'health'",
            )
        if status != 200:
            if status >= 500:
                log.warning("answering %d: %s", status, message)
            if not body:  # else the core's own error reply
                body = RewardApp.error(status, message, "msgpack", rid.decode(errors="replace"))
        with contextlib.suppress(zmq.ZMQError):  # the socket closed under us: shutting down
            await self._sock.send_multipart([identity, str(status).encode(), rid, body])

    async def aclose(self) -> None:
        """Stop taking requests, give running ones `grace_s` to answer, close the socket."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        if self._tasks:
            _, late = await asyncio.wait(set(self._tasks), timeout=self._grace_s)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

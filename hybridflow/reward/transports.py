"""The two ways a reward client reaches a service: HTTP (aiohttp) and ZeroMQ (DEALER).

Both implement `Transport`: send one encoded request body, return the service's
`Answer(status, body)` with HTTP status semantics (the ZeroMQ framing carries the same
codes, see schema.py). A transport knows nothing about retries, batching or validation;
`client.RewardClient` owns those, so both protocols behave identically.

Errors: a transport raises `TransportFailure` (the service could not be reached or did
not answer within `timeout_s`: retryable) or `MalformedAnswer` (it answered, but not
in a form this transport can read: a protocol error). aiohttp/zmq exceptions are
translated here and nowhere else.

Lifecycle: sockets/sessions are created lazily on first use *inside* the caller's event
loop (aiohttp sessions and zmq.asyncio sockets are bound to the loop that made them) and
released by `aclose()` on that same loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit, urlunsplit

import zmq
import zmq.asyncio

from hybridflow.reward.schema import ZMQ_HEALTH, ZMQ_SCORE, Encoding

log = logging.getLogger("hybridflow.reward.transport")


class TransportFailure(Exception):
    """The service was not reachable or too slow. Retryable."""


class MalformedAnswer(Exception):
    """The service answered with something that is not a protocol answer. Not retryable."""


@dataclass(frozen=True)
class Answer:
    status: int  # HTTP-style status code
    body: bytes  # at most max_body_bytes + 1 bytes: longer bodies are cut (and rejected)
    retry_after_s: float | None = None  # from a Retry-After header (HTTP 429/503)
    location: str | None = None  # a redirect's target (HTTP 3xx), reported, not followed


class Transport(Protocol):
    address: str  # the URL/endpoint, as it appears in error messages
    encoding: Encoding

    async def post(self, request_id: str, body: bytes, timeout_s: float) -> Answer: ...

    async def get_health(self, timeout_s: float) -> Answer: ...

    async def aclose(self) -> None: ...


# ---------------------------------------------------------------------------------------
# HTTP


class HttpTransport:
    """POST JSON to `url`; GET `/health` on the same host. One pooled session per loop.

    Redirects are not followed unless `follow_redirects` (a 3xx comes back as an Answer):
    a redirect would silently send samples, and the bearer token, to another address."""

    encoding: Encoding = "json"

    def __init__(
        self,
        url: str,
        *,
        max_connections: int,
        max_body_bytes: int,
        token: str | None,
        follow_redirects: bool = False,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.address = url
        self._health_url = urlunsplit((parts.scheme, parts.netloc, "/health", "", ""))
        self._max_connections = max_connections
        self._max_body = max_body_bytes
        self._follow_redirects = follow_redirects
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._session = None  # aiohttp.ClientSession, created on first use in the loop

    def _get_session(self):
        import aiohttp  # imported here: only stage processes that talk HTTP pay for it

        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                headers=self._headers,
            )
        return self._session

    async def _call(self, method: str, url: str, body: bytes | None, timeout_s: float) -> Answer:
        import aiohttp

        session = self._get_session()
        try:
            async with session.request(
                method,
                url,
                data=body,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                allow_redirects=self._follow_redirects,
            ) as resp:
                data = await read_capped(resp.content, self._max_body + 1)
                return Answer(
                    resp.status,
                    data,
                    _retry_after(resp.headers.get("Retry-After")),
                    resp.headers.get("Location"),
                )
        except TimeoutError as exc:
            raise TransportFailure(f"no answer within timeout_s={timeout_s}") from exc
        except aiohttp.ClientError as exc:
            raise TransportFailure(f"{type(exc).__name__}: {exc}") from exc

    async def post(self, request_id: str, body: bytes, timeout_s: float) -> Answer:
        return await self._call("POST", self.address, body, timeout_s)

    async def get_health(self, timeout_s: float) -> Answer:
        return await self._call("GET", self._health_url, None, timeout_s)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def read_capped(stream, limit: int) -> bytes:
    """Read at most `limit` bytes: an oversize reply is cut here and rejected by the caller
    instead of being buffered whole."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in stream.iter_chunked(1 << 16):
        chunks.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(chunks)[:limit]


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:  # the HTTP-date form: ignore, use our own backoff
        return None


# ---------------------------------------------------------------------------------------
# ZeroMQ


class ZmqTransport:
    """One DEALER socket; a reader task routes replies to callers by the request_id frame.

    IMMEDIATE=1 makes a send wait for a live connection instead of queueing messages for
    a peer that is not there, so a dead service surfaces as a TransportFailure within
    `timeout_s` (and retried messages do not pile up for a later delivery). A socket
    monitor fails the requests in flight as soon as the connection drops (a killed
    service), since their replies can no longer reach this socket. Replies for
    a request nobody waits for any more (a late answer to a timed-out attempt) are
    dropped: the retry of that request, carrying the same request_id, already got or
    will get its own answer.
    """

    encoding: Encoding = "msgpack"

    def __init__(self, endpoint: str, *, max_body_bytes: int, method: bytes = ZMQ_SCORE) -> None:
        if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"not a ZeroMQ endpoint (tcp://, ipc://): {endpoint!r}")
        self.address = endpoint
        self._method = method  # the request's first frame (the environment service: b"env")
        self._max_body = max_body_bytes
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._monitor: asyncio.Task | None = None
        self._pending: dict[bytes, asyncio.Future] = {}
        self._health_seq = 0

    def _ensure(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            self._ctx = zmq.asyncio.Context()
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self._sock = sock
            loop = asyncio.get_running_loop()
            self._reader = loop.create_task(
                self._read_loop(), name=f"reward-zmq-reader {self.address}"
            )
            self._monitor = loop.create_task(
                self._watch(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)),
                name=f"reward-zmq-monitor {self.address}",
            )
        return self._sock

    async def _watch(self, mon: zmq.asyncio.Socket) -> None:
        try:
            while True:
                await mon.recv_multipart()  # only EVENT_DISCONNECTED is subscribed
                lost = [f for f in self._pending.values() if not f.done()]
                for fut in lost:
                    fut.set_exception(
                        TransportFailure("connection lost with the request in flight")
                    )
                if lost:
                    log.info(
                        "%s: connection lost, %d request(s) in flight", self.address, len(lost)
                    )
        finally:
            mon.close(linger=0)

    async def _read_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=True)
            if len(frames) < 2:
                log.warning("dropping a %d-frame reply from %s", len(frames), self.address)
                continue
            fut = self._pending.get(frames[1])
            if fut is None or fut.done():
                log.debug("dropping a late/duplicate reply for %r", frames[1])
                continue
            if len(frames) != 3:
                fut.set_exception(
                    MalformedAnswer(
                        f"reply has {len(frames)} frames, expected 3 (status, id, body)"
                    )
                )
                continue
            status, _, body = frames
            if not status.isdigit() or len(status) != 3:
                fut.set_exception(MalformedAnswer(f"status frame {status[:20]!r} is not a code"))
                continue
            fut.set_result(Answer(int(status), body[: self._max_body + 1]))

    async def _roundtrip(self, method: bytes, rid: bytes, body: bytes, timeout_s: float) -> Answer:
        sock = self._ensure()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        fut = loop.create_future()
        self._pending[rid] = fut
        try:
            # POLLOUT is only signalled once a connection exists (IMMEDIATE=1). Concurrent
            # callers may poll and send at once: pyzmq's asyncio socket queues whole
            # multipart messages, so frames of two requests never interleave.
            ready = await sock.poll(int(timeout_s * 1000), zmq.POLLOUT)
            if not ready & zmq.POLLOUT:
                raise TransportFailure(f"not connected within timeout_s={timeout_s}")
            await sock.send_multipart([method, rid, body])
            left = max(0.0, deadline - loop.time())
            try:
                return await asyncio.wait_for(fut, left)
            except TimeoutError as exc:
                raise TransportFailure(f"no answer within timeout_s={timeout_s}") from exc
        except zmq.ZMQError as exc:
            raise TransportFailure(f"zmq: {exc}") from exc
        finally:
            if self._pending.get(rid) is fut:
                del self._pending[rid]

    async def post(self, request_id: str, body: bytes, timeout_s: float) -> Answer:
        return await self._roundtrip(self._method, request_id.encode(), body, timeout_s)

    async def get_health(self, timeout_s: float) -> Answer:
        self._health_seq += 1
        rid = f"health-{self._health_seq}".encode()
        return await self._roundtrip(ZMQ_HEALTH, rid, b"", timeout_s)

    async def aclose(self) -> None:
        tasks = [t for t in (self._reader, self._monitor) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._reader = self._monitor = None
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

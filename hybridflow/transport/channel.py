"""Asyncio ZeroMQ channels: `send(msg, tensors)` / `recv() -> Received(msg, tensors, peer)`.

Socket patterns and why:
  - coordinator <-> stage: ROUTER (coordinator binds) / DEALER (each stage connects).
    One socket carries both directions, the ROUTER knows every peer by identity, and
    ROUTER_MANDATORY turns a send to a vanished peer into `PeerDeadError` instead of a
    silent drop.
  - stage -> stage streams (weights, bulk data): PUSH / PULL. One direction, no identities,
    and PUSH blocks when the receiver's queue is full: backpressure for free.
Backpressure everywhere: every socket has a bounded high-water mark (`hwm` messages); a
DEALER/PUSH `send` then awaits until the peer drains. The coordinator additionally bounds
in-flight tasks per stage, so its ROUTER never reaches the mark.

Invariants:
  - a malformed message never kills a receiver: `recv` logs it, counts it in
    `bad_messages` and waits for the next one;
  - every wait is bounded by a timeout whose error names the setting to raise;
  - `close()` releases every resource the channel owns (sockets, unclaimed shm).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import zmq
import zmq.asyncio

from hybridflow.errors import PeerDeadError, ProtocolError, TransportTimeout
from hybridflow.transport import protocol
from hybridflow.transport.protocol import Msg, TensorDesc
from hybridflow.transport.tensors import DEFAULT_SHM_THRESHOLD, CudaTier, TensorCodec

log = logging.getLogger(__name__)

SocketKind = Literal["router", "dealer", "push", "pull"]
_ZMQ_TYPES = {"router": zmq.ROUTER, "dealer": zmq.DEALER, "push": zmq.PUSH, "pull": zmq.PULL}


@dataclass
class Received:
    msg: Msg
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    peer: bytes | None = None  # ROUTER only: identity to reply to


class Channel:
    """One ZeroMQ socket plus the tensor codec of this endpoint."""

    def __init__(
        self,
        kind: SocketKind,
        endpoint: str,
        *,
        bind: bool,
        name: str,
        run_id: str = "local",
        identity: bytes | None = None,
        hwm: int = 256,
        shm_threshold: int = DEFAULT_SHM_THRESHOLD,
        cuda: CudaTier | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.name = name
        self.kind = kind
        self.bad_messages = 0
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(_ZMQ_TYPES[kind])
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        if kind == "router":
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if identity is not None:
            self._sock.setsockopt(zmq.IDENTITY, identity)
        self.codec = TensorCodec(run_id=run_id, shm_threshold=shm_threshold, cuda=cuda)
        try:
            if bind:
                self._sock.bind(endpoint)
                # tcp://127.0.0.1:0 binds a free port; report the real address.
                self.endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            else:
                self._sock.connect(endpoint)
                self.endpoint = endpoint
        except zmq.ZMQError as exc:
            self._sock.close(0)
            verb = "bind" if bind else "connect"
            raise PeerDeadError(f"channel {name}: cannot {verb} {endpoint}: {exc}") from exc
        self._closed = False

    # ------------------------------------------------------------------------------
    async def send(
        self,
        msg: Msg,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        to: bytes | None = None,
        timeout: float | None = None,
        timeout_setting: str = "transport.send_timeout_s",
    ) -> None:
        """Send `msg` with `tensors` beside it. `to` is required on a ROUTER."""
        descs: list[TensorDesc]
        buffers: list[Any]
        descs, buffers = self.codec.encode(tensors) if tensors else ([], [])
        frames: list[Any] = protocol.encode(msg, descs) + buffers
        if self.kind == "router":
            if to is None:
                raise ValueError(f"channel {self.name}: a ROUTER send needs `to=`")
            frames.insert(0, to)
        try:
            coro = self._sock.send_multipart(frames, copy=False)
            if timeout is None:
                await coro
            else:
                await asyncio.wait_for(coro, timeout)
        except TimeoutError as exc:
            raise TransportTimeout(
                f"channel {self.name}: send of {type(msg).__name__} blocked for {timeout}s "
                f"(peer not draining); raise `{timeout_setting}` if it is just slow"
            ) from exc
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                peer = to.decode(errors="replace") if to else "?"
                raise PeerDeadError(f"channel {self.name}: peer {peer!r} is not connected") from exc
            raise PeerDeadError(f"channel {self.name}: send failed: {exc}") from exc

    async def recv(
        self,
        timeout: float | None = None,
        *,
        timeout_setting: str = "transport.recv_timeout_s",
    ) -> Received:
        """Next valid message. Malformed ones are logged and skipped, never raised."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                coro = self._sock.recv_multipart(copy=False)
                frames = await (coro if remaining is None else asyncio.wait_for(coro, remaining))
            except TimeoutError as exc:
                raise TransportTimeout(
                    f"channel {self.name}: nothing received for {timeout}s; "
                    f"raise `{timeout_setting}` if the peer is just slow"
                ) from exc
            try:
                return self._decode(frames)
            except ProtocolError as exc:
                self.bad_messages += 1
                log.warning("channel %s: dropped malformed message: %s", self.name, exc)

    def _decode(self, frames: list[Any]) -> Received:
        peer = None
        if self.kind == "router":
            peer = frames[0].bytes
            frames = frames[1:]
        msg, descs, buffers = protocol.decode(frames)
        tensors = self.codec.decode(descs, buffers) if descs else {}
        return Received(msg, tensors, peer)

    # ------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close(linger=0)
        self.codec.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

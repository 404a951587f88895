"""A channel's send path: encode, try now, else wait for room (backpressure) in order.

Backpressure everywhere: every socket has a bounded high-water mark (`hwm` messages); a
DEALER/PUSH `send` then waits until the peer drains (a ROUTER send polls, since a ROUTER
never reports "writable" per peer). Messages naming shared memory are tiny, so HWM alone
would not bound /dev/shm: `send` also waits while more than `shm_inflight_bytes` of
one-shot segments are unopened, and pooled segments are bounded by `shm_pool_bytes`.

The fast path: encode (`_small_frames` for a message without tensors, else `_frames`),
one non-blocking multipart send (`_try_send`), done; the waits (`_send_blocked`,
`_encode_when_room`) are entered only when that fails. The
transport's own acks (`Release`, for what this endpoint received) leave from here too
(`_flush_outbox`), scheduled from any thread by the codec's finalizers.

Invariants: messages leave in the order they were encoded (FIFO behind a waiting send:
NCCL transfers depend on it); a send that does not happen releases what its encoding
took (`codec.abort`); a send to a vanished peer is a `PeerDeadError`, never a silent drop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable, Mapping
from typing import Any, cast

import torch
import zmq

from hybridflow.errors import PeerDeadError, PipelineError, TransportTimeout
from hybridflow.transport import protocol
from hybridflow.transport.channel.gate import PeerGate
from hybridflow.transport.channel.wait import NOBLOCK, POLLOUT, SNDMORE
from hybridflow.transport.protocol import Msg, TensorDesc
from hybridflow.transport.tensors import ShmFull

log = logging.getLogger("hybridflow.transport.channel")

# zmq.Socket.send is a Python wrapper (routing_id, group, Frame checks) around its Cython
# base's `send`; for the frames sent here (no routing_id, no group) it only forwards, at
# about 0.6 us a part on the CPU machine. `_try_send` calls the base's directly.
_zmq_send = zmq.backend.Socket.send


class SendPath(PeerGate):
    """Sending on `Channel` (endpoint.py sets the attributes below)."""

    kind: str  # the socket kind: "router", "dealer", "push" or "pull"
    _send_lock: asyncio.Lock  # held by a send that waits: later sends queue behind it
    _flush_scheduled: bool  # an outbox flush is already on the loop's queue

    async def send(
        self,
        msg: Msg,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        to: bytes | None = None,
        timeout: float | None = None,
        timeout_setting: str = "transport.send_timeout_s",
    ) -> None:
        """Send `msg` with `tensors` beside it. `to` is required on a ROUTER.

        Waits while the peer's queue is full (backpressure), at most `timeout` seconds.
        """
        loop = self._bind_loop()
        if not tensors:
            # Nothing encoded beside the message (nothing to release if it does not go):
            # when no earlier send waits and no ack is due first, one try is all it takes.
            frames = self._small_frames(msg, to)
            if (
                not self._send_lock.locked()
                and not self.codec.has_outbox()
                and self._try_send(frames)
            ):
                return
            descs: list[TensorDesc] = []
            peer: Hashable = to if self._router else None
        else:
            try:
                frames, descs, peer = self._frames(msg, tensors, to)
            except ShmFull:  # rare: wait for receivers to open what we already sent
                deadline = None if timeout is None else loop.time() + timeout
                frames, descs, peer = await self._encode_when_room(loop, msg, tensors, to, deadline)
                if deadline is not None:
                    timeout = max(0.0, deadline - loop.time())
        sent = False
        try:
            if self.codec.has_outbox():
                self._flush_outbox()
            # FIFO: while an earlier send waits, later ones queue behind it, so messages
            # leave in the order they were encoded (NCCL transfers depend on it).
            if not self._send_lock.locked():
                sent = self._try_send(frames)
            if not sent:
                async with self._send_lock:
                    if not self._try_send(frames):
                        await self._send_blocked(loop, frames, msg, timeout, timeout_setting)
                    sent = True
        finally:
            if not sent:
                self.codec.abort(descs, peer)
        if descs:
            self.codec.sent(descs, peer)

    async def _encode_when_room(
        self,
        loop: asyncio.AbstractEventLoop,
        msg: Msg,
        tensors: Mapping[str, torch.Tensor] | None,
        to: bytes | None,
        deadline: float | None,
    ) -> tuple[list[Any], list[TensorDesc], Hashable]:
        # Shared-memory backpressure: too many bytes sent and not yet opened by receivers.
        pause = 0.001
        while True:
            try:
                return self._frames(msg, tensors, to)
            except ShmFull as full:
                if deadline is not None and loop.time() >= deadline:
                    raise TransportTimeout(
                        f"channel {self.name}: {full.args[0]} bytes of shared memory sent and "
                        f"not yet opened by the receiver (limit `transport.shm_inflight_bytes` "
                        f"= {self.codec.shm_inflight_bytes}); the peer is not draining"
                    ) from None
                self._check_peers()
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.02)

    def try_send(self, msg: Msg, *, to: bytes | None = None) -> bool:
        """Send `msg` (no tensors) only if the socket takes it now; False if it is full.

        For heartbeats and acks: a message that cannot go now is skipped, never queued.
        """
        return self._try_send(self._small_frames(msg, to))

    def _check_send(self, to: bytes | None) -> None:
        if self._closed:
            raise PipelineError(f"channel {self.name} is closed")
        if self.kind == "pull":
            raise ValueError(f"channel {self.name}: a PULL socket cannot send")
        if self._router and to is None:
            raise ValueError(f"channel {self.name}: a ROUTER send needs `to=`")

    def _small_frames(self, msg: Msg, to: bytes | None) -> list[Any]:
        """The frames of `msg` without tensors: what `_frames` gives, minus its codec."""
        self._check_send(to)
        frames: list[Any] = protocol.encode(msg)
        if self._router:
            frames.insert(0, self._connection(cast(bytes, to)))
        return frames

    def _frames(
        self, msg: Msg, tensors: Mapping[str, torch.Tensor] | None, to: bytes | None
    ) -> tuple[list[Any], list[TensorDesc], Hashable]:
        self._check_send(to)
        peer = to if self._router else None
        descs: list[TensorDesc]
        buffers: list[Any]
        descs, buffers = self.codec.encode(tensors, peer) if tensors else ([], [])
        try:
            frames: list[Any] = protocol.encode(msg, descs)
        except BaseException:
            self.codec.abort(descs, peer)
            raise
        frames += buffers
        if self._router:
            frames.insert(0, self._connection(cast(bytes, to)))
        return frames, descs, peer

    def _try_send(self, frames: list[Any]) -> bool:
        """Send the whole multipart message now, or nothing (False: the queue is full)."""
        sock = self._sock
        last = len(frames) - 1
        try:
            _zmq_send(sock, frames[0], NOBLOCK | (SNDMORE if last else 0))
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            raise self._send_error(exc, frames) from exc
        # ZeroMQ checks the high-water mark on the first part only: the rest never blocks.
        for i in range(1, last + 1):
            f = frames[i]
            _zmq_send(sock, f, SNDMORE if i < last else 0, copy=not isinstance(f, memoryview))
        self._poke()
        return True

    async def _send_blocked(
        self,
        loop: asyncio.AbstractEventLoop,
        frames: list[Any],
        msg: Msg,
        timeout: float | None,
        timeout_setting: str,
    ) -> None:
        deadline = None if timeout is None else loop.time() + timeout
        pause = 0.0005
        while True:
            if self._router:
                # A ROUTER is always "writable"; the per-peer queue is what is full: poll.
                if deadline is not None and loop.time() >= deadline:
                    break
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.02)
                self._check_peers()
                if self._try_send(frames):
                    return
            elif not await self._wait(loop, POLLOUT, deadline):
                break
            elif self._try_send(frames):
                return
        raise TransportTimeout(
            f"channel {self.name}: send of {type(msg).__name__} blocked for {timeout}s "
            f"(peer not draining); raise `{timeout_setting}` if it is just slow"
        )

    def _send_error(self, exc: zmq.ZMQError, frames: list[Any]) -> PipelineError:
        if exc.errno == zmq.EHOSTUNREACH:
            peer = bytes(frames[0]).decode(errors="replace") if self._router else "?"
            return PeerDeadError(f"channel {self.name}: peer {peer!r} is not connected")
        return PeerDeadError(f"channel {self.name}: send failed: {exc}")

    def reply(self, msg: Msg, conn: bytes) -> bool:
        """Send tensor-less `msg` to connection `conn` (admitted or not) only if the socket
        takes it now: a peer that never reads cannot make us wait. -> sent?"""
        if not self._router:
            raise ValueError(f"channel {self.name}: `reply` is for ROUTER sockets")
        try:
            return self._try_send([conn, *protocol.encode(msg)])
        except PipelineError:  # gone already
            return False

    # The transport's own acks (Release) out: for tensors this endpoint received.

    def _outbox_ready(self) -> None:
        # Called from tensor finalizers, in any thread: only schedule, never touch the socket.
        loop = self._loop
        if loop is None or self._closed or self._flush_scheduled:
            return
        self._flush_scheduled = True
        try:
            loop.call_soon_threadsafe(self._flush_outbox)
        except RuntimeError:  # loop closed: the next operation (or close) flushes
            self._flush_scheduled = False

    def _flush_outbox(self) -> None:
        self._flush_scheduled = False
        if self._closed:
            return
        for peer, rel in self.codec.take_outbox():
            if self._router and peer is None:
                continue
            try:
                frames = protocol.encode(rel)
                if self._router:
                    frames.insert(0, self._connection(cast(bytes, peer)))
                if not self._try_send(frames):
                    log.debug("channel %s: ack to %r deferred (queue full)", self.name, peer)
                    self.codec.requeue(peer, rel)
            except PipelineError as exc:  # the peer is gone: nothing to ack any more
                log.debug("channel %s: ack to %r dropped: %s", self.name, peer, exc)

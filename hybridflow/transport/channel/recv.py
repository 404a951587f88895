"""A channel's receive path: the next valid message, its tensors rebuilt, acks consumed.

The fast path: ZMQ_EVENTS says a message is queued, or the socket's fd just woke us
(then no EVENTS read: the recv itself processes what woke us), one non-blocking
multipart recv (`_try_recv`: small frames as bytes, tensor frames as zmq Frames, copied
once by the codec), decode (`_decode`), return. Only an empty queue waits (wait.py),
on a future `recv` awaits itself.

Invariants:
  - a malformed message never kills a receiver: `recv` logs it, counts it in
    `bad_messages`, tells `on_bad_message` (its owner decides whether the loss is an
    error: a stage's task, a result the coordinator waits for) and waits for the next one;
  - `Release` messages are consumed here (the codec frees what they name), never returned;
  - a gated ROUTER never decodes the tensors of a peer it has not admitted
    (`_untrusted`; gate.py);
  - every message marks its sender as seen in the `PeerTable`; peers are checked for
    death between messages, never with one in hand, and queued input first: a peer whose
    heartbeats wait in our queue is late, not dead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from hybridflow.errors import PeerDeadError, ProtocolError, TransportTimeout
from hybridflow.transport import protocol
from hybridflow.transport.channel.send import SendPath
from hybridflow.transport.channel.wait import NOBLOCK, POLLIN
from hybridflow.transport.protocol import Msg, Release

log = logging.getLogger("hybridflow.transport.channel")

_MAX_PARTS = protocol.MAX_FRAMES + 3  # identity + kind + header + buffers


@dataclass(slots=True)
class Received:
    msg: Msg
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    peer: bytes | None = None  # ROUTER only: identity to reply to (the admitted name if gated)
    # False: a gated ROUTER got this from a connection it has not admitted; `peer` is then
    # the raw connection identity (answer with `reply`), and no tensors were decoded.
    trusted: bool = True


class RecvPath(SendPath):
    """Receiving on `Channel` (endpoint.py sets the attributes below)."""

    bad_messages: int  # malformed messages dropped
    # Called as (peer, error, the message's header body or None) for every message
    # dropped as malformed; the owner turns a lost message it was waiting for into
    # an error (a Channel only counts and logs).
    on_bad_message: Callable[[bytes | None, ProtocolError, Msg | None], None] | None
    acks_received: int  # Release messages consumed here

    async def recv(
        self,
        timeout: float | None = None,
        *,
        timeout_setting: str = "transport.recv_timeout_s",
    ) -> Received:
        """Next valid message. Malformed ones are logged and skipped, never raised."""
        loop = self._bind_loop()
        deadline = None if timeout is None else loop.time() + timeout
        by_fd = False  # the fd woke us: a message most likely waits, so recv at once
        while True:
            if self.codec.has_outbox():
                self._flush_outbox()
            if not by_fd:
                # ZMQ_EVENTS first, not a recv that raises zmq.Again: one call either way,
                # and when nothing is queued it is also the re-arm that sleeping needs.
                events = self._events()
                if not events & POLLIN:
                    # Between messages, never with one in hand; and queued input first: a
                    # peer whose heartbeats wait in our queue is late, not dead.
                    if self._peers_due():
                        self._check_peers()
                    sleep = self._sleep_on(loop, POLLIN, deadline, events)
                    if not isinstance(sleep, bool):
                        by_fd = await sleep
                        sleep = self._woke(loop, POLLIN, deadline)
                    if not sleep:
                        raise TransportTimeout(
                            f"channel {self.name}: nothing received for {timeout}s; "
                            f"raise `{timeout_setting}` if the peer is just slow"
                        )
                    continue
            by_fd = False  # if this recv finds nothing, EVENTS re-arms the fd before a sleep
            frames = self._try_recv()
            if frames is None:
                continue
            try:
                got = self._decode(frames)
            except ProtocolError as exc:
                self._malformed(frames, exc)
                continue
            if got is None:  # a peer not admitted sent tensors or acks: dropped undecoded
                continue
            if self.peers is not None:
                self.peers.seen(got.peer, got.msg)
            if isinstance(got.msg, Release):
                self.acks_received += 1
                self.codec.on_release(got.peer, got.msg)
                continue
            return got

    def _malformed(self, frames: list[Any], exc: ProtocolError) -> None:
        self.bad_messages += 1
        if self.bad_messages <= 10 or self.bad_messages % 1000 == 0:  # no log floods
            log.warning(
                "channel %s: dropped malformed message (%d so far): %s",
                self.name,
                self.bad_messages,
                exc,
            )
        if self.on_bad_message is not None and self._admitted_sender(frames):
            # The owner decides whether this loss matters (a known peer with work in
            # flight: yes); the header, if it decodes, says what was lost.
            peer = self._name_of.get(frames[0], frames[0]) if self._router else None
            self.on_bad_message(peer, exc, _header_of(frames[1:] if self._router else frames))

    def _try_recv(self) -> list[Any] | None:
        sock = self._sock
        frames: list[Any]
        try:
            if self._router:
                # A ROUTER puts the sender's identity before every message, and always
                # more parts after it: bytes, no Frame for its RCVMORE bit.
                frames = [sock.recv(NOBLOCK)]
                more = True
            else:
                first = sock.recv(NOBLOCK, copy=False)
                frames = [first.bytes]
                more = first.more
        except zmq.Again:
            return None
        except zmq.ZMQError as exc:
            raise PeerDeadError(f"channel {self.name}: receive failed: {exc}") from exc
        self._poke()
        # Identity, kind and header are small: bytes are cheapest. Tensor frames stay zmq
        # Frames (no copy until the codec copies them once into tensor memory). Frames
        # carry their RCVMORE bit (`more`): no getsockopt per part. The parts of a message
        # arrive together, so NOBLOCK never fails on one (were it to, never hang: what was
        # read is decoded, and a truncated message is malformed).
        n_small = 3 if self._router else 2
        while more:
            try:
                part = sock.recv(NOBLOCK, copy=False)
            except zmq.Again:
                break
            more = part.more
            if len(frames) <= _MAX_PARTS:  # beyond: drain but drop; decode rejects it
                frames.append(part.bytes if len(frames) < n_small else part)
        return frames

    def _decode(self, frames: list[Any]) -> Received | None:
        peer = None
        if self._router:
            peer = frames[0]
            frames = frames[1:]
            if self.gated:
                name = self._name_of.get(peer)
                if name is None:
                    return self._untrusted(peer, frames)
                peer = name
        msg, descs, buffers = protocol.decode(frames)
        tensors = self.codec.decode(descs, buffers, peer) if descs else {}
        return Received(msg, tensors, peer)

    def _untrusted(self, conn: bytes, frames: list[Any]) -> Received | None:
        """A message of a connection not admitted: its header is validated (bounded; it
        touches nothing), the tensors it describes are never looked at."""
        msg, descs, _ = protocol.decode(frames)
        if not descs and not isinstance(msg, Release):
            return Received(msg, {}, conn, trusted=False)
        self.untrusted_dropped += 1
        if self.untrusted_dropped <= 10 or self.untrusted_dropped % 1000 == 0:
            log.warning(
                "channel %s: %s with %d tensor(s) from %r, a peer not admitted, dropped "
                "undecoded (%d so far)",
                self.name,
                type(msg).__name__,
                len(descs),
                conn,
                self.untrusted_dropped,
            )
        return None


def _header_of(frames: list[Any]) -> Msg | None:
    """The body of a message whose tensors could not be rebuilt (None: not even that)."""
    try:
        return protocol.decode(frames)[0]
    except ProtocolError:
        return None

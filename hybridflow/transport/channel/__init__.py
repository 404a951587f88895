"""Asyncio ZeroMQ channels: `send(msg, tensors)` / `recv() -> Received(msg, tensors, peer)`.

Socket patterns and why:
  - coordinator <-> stage: ROUTER (coordinator binds) / DEALER (each stage connects).
    One socket carries both directions, the ROUTER knows every peer by identity, and
    ROUTER_MANDATORY turns a send to a vanished peer into `PeerDeadError` instead of a
    silent drop. Both directions also carry the transport's own `Release` acks, so
    large CPU tensors use pooled shared memory and CUDA IPC tensors are held until the
    receiver is done.
  - stage -> stage streams (weights, bulk data): PUSH / PULL. One direction, no identities,
    and PUSH blocks when the receiver's queue is full: backpressure for free. No acks can
    flow back, so shared memory is one-shot there.

One class, `Channel`, written in parts, one idea each (each part a base class of the
next, so a method call on the fast path costs what it cost in one class):
  wait.py       how the socket meets asyncio: the fd, the sleepers, the one timer,
                peer deadlines (why not zmq.asyncio, and what the fast path pays)
  gate.py       admission of peers on a gated ROUTER
  send.py       the send path, backpressure, the transport's own acks out
  recv.py       the receive path, `Received`, malformed and untrusted messages
  endpoint.py   the socket itself (options, CurveZMQ, bind/connect) and `close`

Invariants:
  - a malformed message never kills a receiver (recv.py);
  - every wait is bounded by a timeout whose error names the setting to raise, and, with
    a `PeerTable`, by the peers' heartbeat deadline (`PeerDeadError` names the peer);
  - `Release` messages are consumed here, never returned by `recv`;
  - `close()` releases every resource the channel owns (sockets, segments, held tensors);
  - a channel on a `tcp://` endpoint of a run with CurveZMQ keys (transport/curve.py) is a
    Curve server when it binds (its ZAP gate admits the run's clients only) and a Curve
    client when it connects; other channels are plain sockets.
"""

from hybridflow.transport.channel.endpoint import Channel, SocketKind
from hybridflow.transport.channel.recv import Received

__all__ = ["Channel", "Received", "SocketKind"]

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
Backpressure everywhere: every socket has a bounded high-water mark (`hwm` messages); a
DEALER/PUSH `send` then waits until the peer drains (a ROUTER send polls, since a ROUTER
never reports "writable" per peer). Messages naming shared memory are tiny, so HWM alone
would not bound /dev/shm: `send` also waits while more than `shm_inflight_bytes` of
one-shot segments are unopened, and pooled segments are bounded by `shm_pool_bytes`.

How the socket meets asyncio (why not zmq.asyncio): a plain socket, its ZMQ_FD registered
once with the loop, and every operation tried non-blocking first. A recv that finds a
message costs no future at all; one that must wait costs one future and no task. This is
what brings a small-message round trip between two processes near raw pyzmq latency.
ZMQ_FD is edge-triggered: it only says "state may have changed", so waiters always
re-read ZMQ_EVENTS, and any operation of ours wakes the other waiters to re-check.
Per message the fast path pays one ZMQ_EVENTS read per side of a wait, no exception, no
enum arithmetic (zmq's constants are IntFlags: each `|`/`&` on them builds an enum member)
and no timer handle (one lazily re-armed timer serves every bounded wait of the channel:
under uvloop, cancelling a timer closes a handle, which costs one more loop iteration).

Invariants:
  - a malformed message never kills a receiver: `recv` logs it, counts it in
    `bad_messages`, tells `on_bad_message` (its owner decides whether the loss is an
    error: a stage's task, a result the coordinator waits for) and waits for the next one;
  - every wait is bounded by a timeout whose error names the setting to raise, and, with
    a `PeerTable`, by the peers' heartbeat deadline (`PeerDeadError` names the peer);
  - `Release` messages are consumed here, never returned by `recv`;
  - `close()` releases every resource the channel owns (sockets, segments, held tensors);
  - a channel on a `tcp://` endpoint of a run with CurveZMQ keys (transport/curve.py) is a
    Curve server when it binds (its ZAP gate admits the run's clients only) and a Curve
    client when it connects; other channels are plain sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
import zmq

from hybridflow.errors import PeerDeadError, PipelineError, ProtocolError, TransportTimeout
from hybridflow.transport import curve, protocol
from hybridflow.transport.liveness import PeerTable
from hybridflow.transport.protocol import Msg, Release, TensorDesc
from hybridflow.transport.tensors import (
    DEFAULT_SHM_INFLIGHT_BYTES,
    DEFAULT_SHM_POOL_BYTES,
    DEFAULT_SHM_THRESHOLD,
    CudaTier,
    ShmFull,
    TensorCodec,
)

log = logging.getLogger(__name__)

SocketKind = Literal["router", "dealer", "push", "pull"]
_ZMQ_TYPES = {"router": zmq.ROUTER, "dealer": zmq.DEALER, "push": zmq.PUSH, "pull": zmq.PULL}
_MAX_PARTS = protocol.MAX_FRAMES + 3  # identity + kind + header + buffers
# The hot path's zmq constants as plain ints (see the module docstring).
_POLLIN, _POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
_POLL_ANY = _POLLIN | _POLLOUT
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)


@dataclass(slots=True)
class Received:
    msg: Msg
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    peer: bytes | None = None  # ROUTER only: identity to reply to (the admitted name if gated)
    # False: a gated ROUTER got this from a connection it has not admitted; `peer` is then
    # the raw connection identity (answer with `reply`), and no tensors were decoded.
    trusted: bool = True


class Channel:
    """One ZeroMQ socket plus the tensor codec of this endpoint.

    `peers`: an optional liveness table (liveness.py). Every message marks its sender as
    seen (key: ROUTER identity, or None for the single peer of other sockets), and waits
    end with `PeerDeadError`/`StageDeadError` when a watched peer goes silent.

    `gated` (ROUTER only): peers must be admitted by the owner (`admit(connection, name)`,
    after it checked their Hello: transport/auth.py) before anything of theirs is acted
    on. Until then `recv` returns their tensor-less messages with `trusted=False` and the
    raw connection identity, and drops messages with tensors and `Release`s after the
    header (`untrusted_dropped`): no shared memory or CUDA IPC handle they name is ever
    opened, mapped or unlinked, and their malformed messages never reach `on_bad_message`.
    Admitted peers are known by their name on both paths (`send(to=name)`,
    `Received.peer == name`), whatever connection identity they use.
    """

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
        context: zmq.Context | None = None,
        peers: PeerTable | None = None,
        shm_pool_bytes: int = DEFAULT_SHM_POOL_BYTES,
        shm_inflight_bytes: int = DEFAULT_SHM_INFLIGHT_BYTES,
        gated: bool = False,
        listen_fd: int = -1,
        curve_keys: curve.CurveKeys | None = None,
    ) -> None:
        if kind not in _ZMQ_TYPES:
            raise ValueError(f"channel {name}: socket kind {kind!r} not in {sorted(_ZMQ_TYPES)}")
        if gated and kind != "router":
            raise ValueError(f"channel {name}: only a ROUTER can be gated")
        self.gated = gated
        self.untrusted_dropped = 0  # messages of peers not admitted, dropped after the header
        self._conn_of: dict[bytes, bytes] = {}  # admitted name -> connection identity
        self._name_of: dict[bytes, bytes] = {}  # connection identity -> admitted name
        self.name = name
        self.kind = kind
        self.peers = peers
        self.bad_messages = 0
        # Called as (peer, error, the message's header body or None) for every message
        # dropped as malformed; the owner turns a lost message it was waiting for into
        # an error (a Channel only counts and logs).
        self.on_bad_message: Callable[[bytes | None, ProtocolError, Msg | None], None] | None = None
        self.acks_received = 0  # Release messages consumed here
        self._router = kind == "router"
        self._ctx = context or zmq.Context.instance()
        self._sock = zmq.Socket(self._ctx, _ZMQ_TYPES[kind])
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        if self._router:
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if identity is not None:
            self._sock.setsockopt(zmq.IDENTITY, identity)
        self.codec = TensorCodec(
            run_id=run_id,
            shm_threshold=shm_threshold,
            cuda=cuda,
            acks=kind in ("router", "dealer"),
            shm_pool_bytes=shm_pool_bytes,
            shm_inflight_bytes=shm_inflight_bytes,
            on_outbox=self._outbox_ready,
        )
        if listen_fd >= 0:
            # A TCP socket the launcher bound and listens on (the kernel picked the port and
            # it was never released): ZeroMQ adopts it, so no other process can take the
            # port between the choice and this bind (weight links, session.py).
            self._sock.setsockopt(zmq.USE_FD, listen_fd)
        # CurveZMQ on TCP when the run has keys (transport/curve.py): given here (the
        # coordinator), else the process's own (a stage: installed by its bootstrap).
        keys = curve_keys if curve_keys is not None else curve.process_keys()
        self._gate: curve.ZapGate | None = None
        self._curve_domain = ""
        try:
            if keys is not None and endpoint.startswith("tcp://"):
                self.curve = True
                self._curve_domain = keys.domain
                self._gate = curve.apply(self._sock, self._ctx, keys, bind=bind)
            else:
                self.curve = False
            if bind:
                self._sock.bind(endpoint)
                # tcp://127.0.0.1:0 binds a free port; report the real address.
                self.endpoint = cast(bytes, self._sock.getsockopt(zmq.LAST_ENDPOINT)).decode()
            else:
                self._sock.connect(endpoint)
                self.endpoint = endpoint
        except (zmq.ZMQError, RuntimeError) as exc:
            self._sock.close(0)
            self._release_gate()
            verb = "bind" if bind else "connect"
            raise PeerDeadError(f"channel {name}: cannot {verb} {endpoint}: {exc}") from exc
        self._fd = cast(int, self._sock.getsockopt(zmq.FD))
        self._loop: asyncio.AbstractEventLoop | None = None
        # Tasks sleeping until the socket may be readable (POLLIN) / writable (POLLOUT).
        self._waiters: dict[int, list[asyncio.Future[None]]] = {_POLLIN: [], _POLLOUT: []}
        # The one timer that bounds every sleeper's wait: armed for the earliest wake-up
        # asked for; firing early only makes the sleepers re-check (and re-arm it).
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._flush_scheduled = False
        self._send_lock = asyncio.Lock()
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
        """Send `msg` with `tensors` beside it. `to` is required on a ROUTER.

        Waits while the peer's queue is full (backpressure), at most `timeout` seconds.
        """
        loop = self._bind_loop()
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
        frames, _, _ = self._frames(msg, None, to)
        return self._try_send(frames)

    def _frames(
        self, msg: Msg, tensors: Mapping[str, torch.Tensor] | None, to: bytes | None
    ) -> tuple[list[Any], list[TensorDesc], Hashable]:
        if self._closed:
            raise PipelineError(f"channel {self.name} is closed")
        if self.kind == "pull":
            raise ValueError(f"channel {self.name}: a PULL socket cannot send")
        if self._router and to is None:
            raise ValueError(f"channel {self.name}: a ROUTER send needs `to=`")
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
            sock.send(frames[0], _NOBLOCK | (_SNDMORE if last else 0))
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            raise self._send_error(exc, frames) from exc
        # ZeroMQ checks the high-water mark on the first part only: the rest never blocks.
        for i in range(1, last + 1):
            f = frames[i]
            sock.send(f, _SNDMORE if i < last else 0, copy=not isinstance(f, memoryview))
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
            elif not await self._wait(loop, _POLLOUT, deadline):
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

    # ------------------------------------------------------------------------------
    async def recv(
        self,
        timeout: float | None = None,
        *,
        timeout_setting: str = "transport.recv_timeout_s",
    ) -> Received:
        """Next valid message. Malformed ones are logged and skipped, never raised."""
        loop = self._bind_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if self.codec.has_outbox():
                self._flush_outbox()
            # ZMQ_EVENTS first, not a recv that raises zmq.Again: one call either way,
            # and when nothing is queued it is also the re-arm that `_wait` needs.
            events = self._events()
            if not events & _POLLIN:
                # Between messages, never with one in hand; and queued input first: a peer
                # whose heartbeats wait in our queue is late, not dead.
                if self._peers_due():
                    self._check_peers()
                if not await self._wait(loop, _POLLIN, deadline, events):
                    raise TransportTimeout(
                        f"channel {self.name}: nothing received for {timeout}s; "
                        f"raise `{timeout_setting}` if the peer is just slow"
                    )
                continue
            frames = self._try_recv()
            if frames is None:
                continue
            try:
                got = self._decode(frames)
            except ProtocolError as exc:
                self.bad_messages += 1
                if self.bad_messages <= 10 or self.bad_messages % 1000 == 0:  # no log floods
                    log.warning(
                        "channel %s: dropped malformed message (%d so far): %s",
                        self.name,
                        self.bad_messages,
                        exc,
                    )
                if self.on_bad_message is not None and self._admitted_sender(frames):
                    # The owner decides whether this loss matters (a known peer with work
                    # in flight: yes); the header, if it decodes, says what was lost.
                    peer = self._name_of.get(frames[0], frames[0]) if self._router else None
                    self.on_bad_message(
                        peer, exc, _header_of(frames[1:] if self._router else frames)
                    )
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

    def _try_recv(self) -> list[Any] | None:
        sock = self._sock
        try:
            first = sock.recv(_NOBLOCK, copy=False)
        except zmq.Again:
            return None
        except zmq.ZMQError as exc:
            raise PeerDeadError(f"channel {self.name}: receive failed: {exc}") from exc
        self._poke()
        # Identity, kind and header are small: bytes are cheapest. Tensor frames stay zmq
        # Frames (no copy until the codec copies them once into tensor memory). Frames
        # carry their RCVMORE bit (`more`): no getsockopt per part.
        frames: list[Any] = [first.bytes]
        n_small = 3 if self._router else 2
        more = first.more
        while more:
            part = sock.recv(0, copy=False)
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

    def _admitted_sender(self, frames: list[Any]) -> bool:
        return not self.gated or frames[0] in self._name_of

    # ------------------------------------------------------------------------------
    # admission (gated ROUTER)

    def admit(self, conn: bytes, name: bytes) -> None:
        """Messages of connection `conn` now come from `name`, and `send(to=name)` goes to
        it. The owner calls this only once it checked the peer's proof. A name admitted
        again (a reconnect) moves to the new connection."""
        old = self._conn_of.pop(name, None)
        if old is not None:
            self._name_of.pop(old, None)
        self._conn_of[name] = conn
        self._name_of[conn] = name

    def admitted(self, name: bytes) -> bool:
        return name in self._conn_of

    def reply(self, msg: Msg, conn: bytes) -> bool:
        """Send tensor-less `msg` to connection `conn` (admitted or not) only if the socket
        takes it now: a peer that never reads cannot make us wait. -> sent?"""
        if not self._router:
            raise ValueError(f"channel {self.name}: `reply` is for ROUTER sockets")
        try:
            return self._try_send([conn, *protocol.encode(msg)])
        except PipelineError:  # gone already
            return False

    def _connection(self, to: bytes) -> bytes:
        if not self.gated:
            return to
        conn = self._conn_of.get(to)
        if conn is None:  # never a raw identity: a squatter may hold that one
            raise PeerDeadError(f"channel {self.name}: peer {to!r} has not been admitted")
        return conn

    # ------------------------------------------------------------------------------
    # asyncio glue

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            if self._closed:
                raise PipelineError(f"channel {self.name} is closed")
            self._unbind_loop()
            loop.add_reader(self._fd, self._on_readable)
            self._loop = loop
        return loop

    def _unbind_loop(self) -> None:
        self._cancel_timer()
        old, self._loop = self._loop, None
        if old is not None and not old.is_closed():
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                old.remove_reader(self._fd)

    def _events(self) -> int:
        """ZMQ_EVENTS (POLLIN | POLLOUT bits); reading it re-arms the edge-triggered fd."""
        return cast(int, self._sock.getsockopt(_EVENTS))

    def _on_readable(self) -> None:
        if self._closed:
            return
        if self._waiters[_POLLIN] or self._waiters[_POLLOUT]:
            # Each sleeper re-reads ZMQ_EVENTS or retries its operation before it sleeps
            # again, which re-arms the fd. The loop's poll is level-triggered: should none
            # of them get to it (cancelled meanwhile), this runs again and drains it below.
            self._wake()
        else:
            self._sock.getsockopt(_EVENTS)  # nobody to re-check: re-arm the fd here

    def _wake(self, flag: int = _POLL_ANY) -> None:
        for f in (_POLLIN, _POLLOUT):
            if flag & f and self._waiters[f]:
                waiters, self._waiters[f] = self._waiters[f], []
                for fut in waiters:
                    if not fut.done():
                        fut.set_result(None)

    def _poke(self) -> None:
        """An operation of ours succeeded; it may have consumed the fd's edge while the
        socket holds more for others (a second message, room to send): let every sleeper
        re-check. Free when nobody sleeps, which is the common case."""
        if self._waiters[_POLLIN] or self._waiters[_POLLOUT]:
            self._wake()

    async def _wait(
        self,
        loop: asyncio.AbstractEventLoop,
        flag: int,
        deadline: float | None,
        events: int | None = None,
    ) -> bool:
        """Wait until the socket may have `flag` (True: the caller retries its operation,
        which may still find nothing) or `deadline` passes (False); raise PeerDeadError if
        a watched peer dies meanwhile. `events`: ZMQ_EVENTS as the caller just read it,
        with no socket operation since (else it is read here)."""
        if self._closed:
            raise PipelineError(f"channel {self.name} is closed")
        # Reading EVENTS re-arms the fd: only after this may we sleep on it. If it shows
        # what the other kind of sleeper waits for, wake them: the edge is gone now.
        if events is None:
            events = self._events()
        other = flag ^ _POLL_ANY
        if events & other and self._waiters[other]:
            self._wake(other)
        if events & flag:
            return True
        now = loop.time()
        if deadline is not None and now >= deadline:
            return False
        wake_at = deadline
        if self.peers is not None:
            self._check_peers()
            peer_deadline = self.peers.next_deadline()
            if peer_deadline is not None:
                at = now + max(0.0, peer_deadline - self.peers.clock()) + 1e-3
                wake_at = at if wake_at is None else min(wake_at, at)
        fut = loop.create_future()
        self._waiters[flag].append(fut)
        if wake_at is not None and wake_at < self._timer_at:
            self._arm_timer(loop, wake_at)
        await fut
        if self._closed:
            raise PipelineError(f"channel {self.name} is closed")
        return deadline is None or loop.time() < deadline or bool(self._events() & flag)

    def _arm_timer(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        self._cancel_timer()
        self._timer_at = when
        self._timer = loop.call_at(when, self._on_timer)

    def _cancel_timer(self) -> None:
        timer, self._timer, self._timer_at = self._timer, None, math.inf
        if timer is not None:
            timer.cancel()

    def _on_timer(self) -> None:
        # Every sleeper re-checks its own deadline; those not due yet sleep again and
        # re-arm the timer for the earliest of them.
        self._timer, self._timer_at = None, math.inf
        self._wake()

    def _peers_due(self) -> bool:
        if self.peers is None:
            return False
        due = self.peers.next_deadline()
        return due is not None and due <= self.peers.clock()

    def _check_peers(self) -> None:
        if self.peers is None:
            return
        dead = self.peers.pop_dead()
        if dead is not None:
            info, error = dead
            self.forget_peer(info.key, info.pid)
            raise error

    def forget_peer(self, peer: Hashable, pid: int | None = None) -> None:
        """`peer` is dead: free what is held for it, sweep its leftover shared memory."""
        self.codec.forget_peer(peer, pid)

    # ------------------------------------------------------------------------------
    # acks (Release) out

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

    # ------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        try:
            self._flush_outbox()  # best effort: let peers reuse what we were sent
        except Exception as exc:  # never let close fail
            log.debug("channel %s: final ack flush failed: %s", self.name, exc)
        self._closed = True
        self._unbind_loop()
        self._wake()
        self._sock.close(linger=0)
        self._release_gate()
        self.codec.close()

    def _release_gate(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.release(self._curve_domain)

    @property
    def refused(self) -> int:
        """Curve handshakes the run's ZAP gate refused (all sockets of this domain)."""
        gate = curve.ZapGate.of(self._ctx)
        return gate.refused.get(self._curve_domain, 0) if self._curve_domain else 0

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _header_of(frames: list[Any]) -> Msg | None:
    """The body of a message whose tensors could not be rebuilt (None: not even that)."""
    try:
        return protocol.decode(frames)[0]
    except ProtocolError:
        return None

"""How a channel's socket meets asyncio: the fd, the sleepers, the one timer, peer deadlines.

Why not zmq.asyncio: a plain socket, its ZMQ_FD registered once with the loop
(`_bind_loop`), and every operation tried non-blocking first (send.py,
recv.py). A recv that finds a message costs no future at all; one that must wait
costs one future and no task (`_wait`). This is what brings a small-message round trip
between two processes near raw pyzmq latency.

ZMQ_FD is edge-triggered: it only says "state may have changed", so a waiter reads
ZMQ_EVENTS before it sleeps, and any operation of ours wakes the other waiters to re-check
(`_poke`). Per message the fast path pays one ZMQ_EVENTS read per wait (a sleeper woken
by the fd itself retries its operation at once: its result says whether the fd woke it,
and the operation processes the socket's commands as the read would), no exception, no
enum arithmetic (zmq's constants are IntFlags: each `|`/`&` on them builds an enum member,
hence the plain ints below) and no timer handle (one lazily re-armed timer serves every
bounded wait of the channel: under uvloop, cancelling a timer closes a handle, which
costs one more loop iteration). A receive awaits its future itself (`_sleep_on`,
`_woke`): no coroutine in between.

Invariant: every wait is bounded by its deadline and, with a `PeerTable`, by the peers'
heartbeat deadline (`PeerDeadError` names the peer); a closed channel wakes every sleeper
and each raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Hashable
from typing import Any, cast

import zmq

from hybridflow.errors import PipelineError
from hybridflow.transport.liveness import PeerTable
from hybridflow.transport.tensors import TensorCodec

# The hot path's zmq constants as plain ints (see the module docstring).
POLLIN, POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
POLL_ANY = POLLIN | POLLOUT
NOBLOCK, SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
EVENTS = int(zmq.EVENTS)


class SocketWaits:
    """The asyncio side of `Channel` (endpoint.py, which sets every attribute below)."""

    name: str
    peers: PeerTable | None
    codec: TensorCodec
    _sock: zmq.Socket[Any]
    _closed: bool
    _fd: int  # the socket's ZMQ_FD, registered with the loop the channel is used on
    _loop: asyncio.AbstractEventLoop | None
    # Tasks sleeping until the socket may be readable (POLLIN) / writable (POLLOUT); the
    # result: True if the fd woke them (likely a message), False for a poke or the timer.
    _waiters: dict[int, list[asyncio.Future[bool]]]
    # The one timer that bounds every sleeper's wait: armed for the earliest wake-up
    # asked for; firing early only makes the sleepers re-check (and re-arm it).
    _timer: asyncio.TimerHandle | None
    _timer_at: float

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
        return cast(int, self._sock.getsockopt(EVENTS))

    def _on_readable(self) -> None:
        if self._closed:
            return
        if self._waiters[POLLIN] or self._waiters[POLLOUT]:
            # Each sleeper re-reads ZMQ_EVENTS or retries its operation before it sleeps
            # again, which re-arms the fd. The loop's poll is level-triggered: should none
            # of them get to it (cancelled meanwhile), this runs again and drains it below.
            self._wake(POLL_ANY, True)
        else:
            self._sock.getsockopt(EVENTS)  # nobody to re-check: re-arm the fd here

    def _wake(self, flag: int = POLL_ANY, by_fd: bool = False) -> None:
        for f in (POLLIN, POLLOUT):
            if flag & f and self._waiters[f]:
                waiters, self._waiters[f] = self._waiters[f], []
                for fut in waiters:
                    if not fut.done():
                        fut.set_result(by_fd)

    def _poke(self) -> None:
        """An operation of ours succeeded; it may have consumed the fd's edge while the
        socket holds more for others (a second message, room to send): let every sleeper
        re-check. Free when nobody sleeps, which is the common case."""
        if self._waiters[POLLIN] or self._waiters[POLLOUT]:
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
        sleep = self._sleep_on(loop, flag, deadline, events)
        if isinstance(sleep, bool):
            return sleep
        await sleep
        return self._woke(loop, flag, deadline)

    def _sleep_on(
        self,
        loop: asyncio.AbstractEventLoop,
        flag: int,
        deadline: float | None,
        events: int | None,
    ) -> asyncio.Future[bool] | bool:
        """`_wait` up to its sleep: True (retry now: `events` has `flag`), False (the
        deadline passed), or the future to await, then `_woke`. Its result is True if the
        fd woke it, when the retried operation will most likely find what it waits for."""
        if self._closed:
            raise PipelineError(f"channel {self.name} is closed")
        # Reading EVENTS re-arms the fd: only after this may we sleep on it. If it shows
        # what the other kind of sleeper waits for, wake them: the edge is gone now.
        if events is None:
            events = self._events()
        other = flag ^ POLL_ANY
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
        fut: asyncio.Future[bool] = loop.create_future()
        self._waiters[flag].append(fut)
        if wake_at is not None and wake_at < self._timer_at:
            self._arm_timer(loop, wake_at)
        return fut

    def _woke(self, loop: asyncio.AbstractEventLoop, flag: int, deadline: float | None) -> bool:
        """After the sleep of `_sleep_on`: True (retry the operation) or False (timed out)."""
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

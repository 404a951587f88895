"""`Channel`, the socket itself: its ZeroMQ options, CurveZMQ on TCP, bind/connect, and
`close`, which releases everything the channel owns. The parts it is built from (its base
classes: recv.py on send.py on gate.py on wait.py) and the invariants they keep are drawn
in the package docstring (transport/channel/__init__.py)."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Literal, cast

import zmq

from hybridflow.errors import PeerDeadError
from hybridflow.transport import curve
from hybridflow.transport.channel.recv import RecvPath
from hybridflow.transport.channel.wait import POLLIN, POLLOUT
from hybridflow.transport.liveness import PeerTable
from hybridflow.transport.tensors import (
    DEFAULT_SHM_INFLIGHT_BYTES,
    DEFAULT_SHM_POOL_BYTES,
    DEFAULT_SHM_THRESHOLD,
    CudaTier,
    TensorCodec,
)

__all__ = ["Channel", "SocketKind"]

log = logging.getLogger(__name__)

SocketKind = Literal["router", "dealer", "push", "pull"]
_ZMQ_TYPES = {"router": zmq.ROUTER, "dealer": zmq.DEALER, "push": zmq.PUSH, "pull": zmq.PULL}


class Channel(RecvPath):
    """One ZeroMQ socket plus the tensor codec of this endpoint.

    `peers`: an optional liveness table (transport/liveness.py). Every message marks its sender as
    seen (key: ROUTER identity, or None for the single peer of other sockets), and waits
    end with `PeerDeadError`/`StageDeadError` when a watched peer goes silent.

    `gated` (ROUTER only): peers must be admitted by the owner (`admit(connection, name)`,
    after it checked their Hello) before anything of theirs is acted on (gate.py).
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
        self.untrusted_dropped = 0
        self._conn_of = {}
        self._name_of = {}
        self.name = name
        self.kind = kind
        self.peers = peers
        self.bad_messages = 0
        self.on_bad_message = None
        self.acks_received = 0
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
        self._open(endpoint, bind, listen_fd, curve_keys)
        self._fd = cast(int, self._sock.getsockopt(zmq.FD))
        self._loop = None
        self._waiters = {POLLIN: [], POLLOUT: []}
        self._timer = None
        self._timer_at = math.inf
        self._flush_scheduled = False
        self._send_lock = asyncio.Lock()
        self._closed = False

    def _open(
        self, endpoint: str, bind: bool, listen_fd: int, curve_keys: curve.CurveKeys | None
    ) -> None:
        """CurveZMQ if the run has keys, then bind or connect; `self.endpoint` is the real
        address. A failure closes the socket and is a PeerDeadError naming the endpoint."""
        if listen_fd >= 0:
            # A TCP socket the launcher bound and listens on (the kernel picked the port and
            # it was never released): ZeroMQ adopts it, so no other process can take the
            # port between the choice and this bind (a weight link: runtime/stage_specs.py).
            self._sock.setsockopt(zmq.USE_FD, listen_fd)
        # CurveZMQ on TCP when the run has keys (transport/curve.py): given here (the
        # coordinator), else the process's own (a stage: installed by its bootstrap).
        keys = curve_keys if curve_keys is not None else curve.process_keys()
        self._gate: curve.ZapGate | None = None
        self._curve_domain = ""
        try:
            if keys is not None and endpoint.startswith("tcp://"):
                self._curve_domain = keys.domain
                self._gate = curve.apply(self._sock, self._ctx, keys, bind=bind)
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
            raise PeerDeadError(f"channel {self.name}: cannot {verb} {endpoint}: {exc}") from exc

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

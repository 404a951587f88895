"""CurveZMQ for runs whose sockets leave loopback: per-run keys and a ZAP gate.

    coordinator (session)                     stage process (any host)
      keys = RunKeys.new(process names)         bootstrap: install(CurveKeys from stdin)
      ROUTER: curve_server, ZAP domain          DEALER: curve client with its own pair
      ZapGate: admits the run's client keys     weight-link ROUTER it binds: server too
      only, counts and logs every refusal

One server keypair per run (every socket of the run that binds TCP serves with it) and
one client keypair per stage process. The ZAP gate of a process (one thread per ZeroMQ
context, bound to inproc://zeromq.zap.01 while any Curve server socket of the process is
open) admits a handshake only if its client public key is one of the run's; anything
else (no Curve, a wrong server key, an unknown client key) never completes the
handshake, so not a single message of it reaches the socket's owner.

Invariants: keys travel only in the launcher's stdin payload (never argv, the environment
or a file) and are Z85 text; `install` is per process (the launcher's child bootstrap);
a Channel applies keys only to `tcp://` endpoints; loopback runs make no keys at all
(`needed`), so their sockets are exactly as before. The stage processes of a run share
its server secret (their weight links bind): the trust boundary is the run, as for the
Hello secret (auth.py). The gate is registered before the socket binds and released when
it closes; without a gate libzmq would admit any client that knows the server key.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import zmq
from zmq.utils import z85

from hybridflow.config.schema import is_loopback

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"


def available() -> bool:
    return bool(zmq.has("curve"))


def needed(protocol: str, host: str) -> bool:
    """Whether a run's sockets need Curve: TCP bound off loopback."""
    return protocol == "tcp" and not is_loopback(host)


@dataclass(frozen=True)
class CurveKeys:
    """One process's view of the run's keys (all Z85 text)."""

    server_public: bytes
    server_secret: bytes = field(repr=False)  # for the sockets this process binds
    public: bytes  # this process's client pair
    secret: bytes = field(repr=False, default=b"")
    allowed: frozenset[bytes] = frozenset()  # client public keys a server admits
    domain: str = "hybridflow"  # the ZAP domain: the run id

    def to_payload(self) -> dict[str, Any]:
        return {
            "server_public": self.server_public.decode(),
            "server_secret": self.server_secret.decode(),
            "public": self.public.decode(),
            "secret": self.secret.decode(),
            "allowed": sorted(k.decode() for k in self.allowed),
            "domain": self.domain,
        }

    @classmethod
    def from_payload(cls, data: dict[str, Any]) -> CurveKeys:
        return cls(
            server_public=str(data["server_public"]).encode(),
            server_secret=str(data["server_secret"]).encode(),
            public=str(data["public"]).encode(),
            secret=str(data["secret"]).encode(),
            allowed=frozenset(str(k).encode() for k in data["allowed"]),
            domain=str(data.get("domain") or "hybridflow"),
        )


@dataclass(frozen=True)
class RunKeys:
    """Every key of one run: made by the coordinator, handed out per process."""

    server: tuple[bytes, bytes]  # (public, secret)
    clients: dict[str, tuple[bytes, bytes]]  # process name -> (public, secret)
    domain: str

    @classmethod
    def new(cls, names: Iterable[str], domain: str) -> RunKeys:
        if not available():
            raise RuntimeError("this libzmq has no CurveZMQ (zmq.has('curve') is False)")
        return cls(zmq.curve_keypair(), {n: zmq.curve_keypair() for n in names}, domain)

    def for_process(self, name: str) -> CurveKeys:
        pub, sec = self.clients[name]
        return CurveKeys(self.server[0], self.server[1], pub, sec, self._allowed(), self.domain)

    def for_server(self) -> CurveKeys:
        """The coordinator's keys: the server pair and the admitted clients."""
        return CurveKeys(self.server[0], self.server[1], b"", b"", self._allowed(), self.domain)

    def _allowed(self) -> frozenset[bytes]:
        return frozenset(pub for pub, _ in self.clients.values())


_process_keys: CurveKeys | None = None


def install(keys: CurveKeys | None) -> None:
    """Make `keys` the default of every Channel of this process (stage bootstrap)."""
    global _process_keys
    _process_keys = keys


def process_keys() -> CurveKeys | None:
    return _process_keys


def apply(
    sock: zmq.Socket[Any], ctx: zmq.Context[Any], keys: CurveKeys, *, bind: bool
) -> ZapGate | None:
    """Set `sock` up as a Curve server (bind: returns the gate it registered with; call
    `gate.release(keys.domain)` when the socket closes) or client (connect)."""
    if bind:
        gate = ZapGate.of(ctx)
        gate.register(keys.domain, keys.allowed)
        sock.setsockopt(zmq.ZAP_DOMAIN, keys.domain.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
        return gate
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    return None


class ZapGate:
    """The ZAP handler of one ZeroMQ context: domain -> admitted client keys (binary)."""

    _gates: ClassVar[dict[int, ZapGate]] = {}
    _lock = threading.Lock()  # the gates, and each gate's tables

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.ctx = ctx
        self.allowed: dict[str, frozenset[bytes]] = {}
        self.users: dict[str, int] = {}  # domain -> sockets registered
        self.refused: dict[str, int] = {}  # domain -> handshakes refused
        self.admitted: dict[str, int] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = ""
        self._life = threading.Lock()

    @classmethod
    def of(cls, ctx: zmq.Context[Any]) -> ZapGate:
        with cls._lock:
            gate = cls._gates.get(id(ctx))
            if gate is None:
                gate = cls._gates[id(ctx)] = cls(ctx)
            return gate

    def register(self, domain: str, allowed: Iterable[bytes]) -> None:
        keys = frozenset(z85.decode(k) for k in allowed)
        with self._life:  # one start/stop at a time: never two handlers on the endpoint
            with self._lock:
                self.allowed[domain] = self.allowed.get(domain, frozenset()) | keys
                self.users[domain] = self.users.get(domain, 0) + 1
            if self._thread is not None:
                return
            self._stop.clear()
            self._ready.clear()
            self._failed = ""
            self._thread = threading.Thread(target=self._serve, name="zap", daemon=True)
            self._thread.start()
            if not self._ready.wait(10.0) or self._failed:
                self._thread = None
                self._stop.set()
                raise RuntimeError(f"the ZAP handler did not start: {self._failed or 'timeout'}")

    def release(self, domain: str) -> None:
        with self._life:
            with self._lock:
                left = self.users.get(domain, 0) - 1
                if left > 0:
                    self.users[domain] = left
                    return
                self.users.pop(domain, None)
                self.allowed.pop(domain, None)
                if self.users or self._thread is None:
                    return
            thread, self._thread = self._thread, None
            self._stop.set()
            thread.join(5.0)

    def _serve(self) -> None:
        sock = self.ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            sock.close(0)
            self._failed = f"cannot bind {ZAP_ENDPOINT}: {exc}"
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(100, zmq.POLLIN):
                    sock.send_multipart(self._answer(sock.recv_multipart()))
        finally:
            sock.close(0)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        """ZAP 1.0 (RFC 27): version, request id, domain, address, identity, mechanism,
        credentials... -> version, request id, status, text, user id, metadata."""
        if len(frames) < 6 or frames[0] != b"1.0":
            log.warning("malformed ZAP request refused")
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"400", b"bad request", b"", b""]
        request_id, domain = frames[1], frames[2].decode(errors="replace")
        address, mechanism = frames[3].decode(errors="replace"), frames[5]
        key = frames[6] if mechanism == b"CURVE" and len(frames) > 6 else b""
        with self._lock:
            ok = bool(key) and key in self.allowed.get(domain, frozenset())
            counts = self.admitted if ok else self.refused
            counts[domain] = counts.get(domain, 0) + 1
        if ok:
            return [b"1.0", request_id, b"200", b"OK", b"", b""]
        log.warning(
            "refused a %s connection from %s to domain %s (not a client of this run)",
            mechanism.decode(errors="replace"),
            address,
            domain,
        )
        return [b"1.0", request_id, b"400", b"not a client of this run", b"", b""]

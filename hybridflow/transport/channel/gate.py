"""Admission of peers on a gated ROUTER channel: who a connection is, once proven.

`gated` (ROUTER only): peers must be admitted by the owner (`admit(connection, name)`,
after it checked their Hello: transport/auth.py) before anything of theirs is acted
on. Until then `recv` returns their tensor-less messages with `trusted=False` and the
raw connection identity, and drops messages with tensors and `Release`s after the
header (`untrusted_dropped`, recv.py): no shared memory or CUDA IPC handle they
name is ever opened, mapped or unlinked, and their malformed messages never reach
`on_bad_message`. Admitted peers are known by their name on both paths
(`send(to=name)`, `Received.peer == name`), whatever connection identity they use; an
answer to a peer not admitted goes by its connection (`reply`, send.py).

Invariant: a send by name never falls back to a raw connection identity (a squatter may
hold that one): a name not admitted is a `PeerDeadError`.
"""

from __future__ import annotations

from typing import Any

from hybridflow.errors import PeerDeadError
from hybridflow.transport.channel.wait import SocketWaits


class PeerGate(SocketWaits):
    """The admission table of `Channel` (endpoint.py sets the attributes below)."""

    gated: bool
    untrusted_dropped: int  # messages of peers not admitted, dropped after the header
    _router: bool
    _conn_of: dict[bytes, bytes]  # admitted name -> connection identity
    _name_of: dict[bytes, bytes]  # connection identity -> admitted name

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

    def _connection(self, to: bytes) -> bytes:
        if not self.gated:
            return to
        conn = self._conn_of.get(to)
        if conn is None:  # never a raw identity: a squatter may hold that one
            raise PeerDeadError(f"channel {self.name}: peer {to!r} has not been admitted")
        return conn

    def _admitted_sender(self, frames: list[Any]) -> bool:
        return not self.gated or frames[0] in self._name_of

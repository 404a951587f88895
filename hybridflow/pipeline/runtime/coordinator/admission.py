"""The Hello gate: which connections of the coordinator's socket are the run's stages.

The coordinator's ROUTER is `gated` (transport/channel/gate.py): nothing a connection sends
is acted on before it is admitted, and only its Hello is read. `Gate.welcome` admits a
connection under its stage's name when the Hello carries a proof of the run's secret for
(run, stage, replica, connection) (transport/auth.py) and the stage is not in already;
then it compares config hashes:

    no valid proof / unknown stage    -> Welcome(accepted=False), counted and logged;
    a second Hello for a stage in     the run goes on: whoever sent it cannot fail or
                                      stall it (the refusal is a non-blocking reply)
    proof ok, config hash differs     -> Welcome(accepted=False, reason); the run ends
    proof ok, same config             -> Welcome(accepted=True); the stage is connected
                                      and its silence clock starts (`PeerTable`)
"""

from __future__ import annotations

import logging

from hybridflow.errors import PipelineError
from hybridflow.pipeline.runtime.peers import StagePeer
from hybridflow.transport import auth
from hybridflow.transport.channel import Channel
from hybridflow.transport.liveness import PeerTable
from hybridflow.transport.protocol import Hello, Welcome

log = logging.getLogger("hybridflow.coordinator")


class Gate:
    def __init__(
        self,
        chan: Channel,
        peers: dict[bytes, StagePeer],
        seen: PeerTable,
        *,
        run_id: str,
        config_hash: str,
        secret: bytes,
    ) -> None:
        self.chan = chan
        self.peers = peers
        self.seen = seen  # when each connected stage was last heard from
        self.run_id = run_id
        self.config_hash = config_hash  # the one every stage process must have
        self.secret = secret  # the run's; a Hello without a proof keyed by it is refused
        self.refused = 0  # Hellos refused (no valid proof, unknown stage, already connected)

    async def welcome(self, conn: bytes, hello: Hello) -> PipelineError | None:
        """Hello of connection `conn`, not admitted yet (module docstring); -> the error
        that ends the run (a stage of another config), else None."""
        name = f"{hello.stage}/{hello.replica}".encode()
        peer = self.peers.get(name)
        if peer is None or not auth.verify(
            self.secret, self.run_id, hello.stage, hello.replica, conn, hello.proof
        ):
            who = name.decode(errors="replace")
            self.refuse(conn, f"Hello as {who} without a valid proof", answer=True)
            return None
        if peer.connected:  # the stage's own connection is in already: a replay
            self.refuse(conn, f"second Hello as {peer.info.name}", answer=True)
            return None
        info = peer.info
        self.chan.admit(conn, name)
        reason = ""
        if hello.config_hash != self.config_hash:
            reason = (
                f"config hash {hello.config_hash} differs from the coordinator's "
                f"{self.config_hash}; every process must run the same topology"
            )
        await self.chan.send(
            Welcome(run_id=self.run_id, accepted=not reason, reason=reason), to=name
        )
        if reason:
            return PipelineError(f"stage {info.stage} replica {info.replica} rejected: {reason}")
        peer.pid, peer.connected = hello.pid, True
        self.watch(name, peer)
        return None

    def watch(self, ident: bytes, peer: StagePeer) -> None:
        """Start the silence clock of a connected stage."""
        info = peer.info
        self.seen.add(
            ident, label=peer.name(), stage=info.stage, replica=info.replica, pid=peer.pid
        )

    def refuse(self, conn: bytes | None, why: str, *, answer: bool = False) -> None:
        """Count and log (without flooding) a message of a connection that has not proven
        itself; `answer` a Hello with Welcome(accepted=False), never waiting for it."""
        self.refused += 1
        if self.refused <= 10 or self.refused % 1000 == 0:
            log.warning("refused connection %r: %s (%d refused so far)", conn, why, self.refused)
        if answer and conn is not None:
            self.chan.reply(
                Welcome(run_id=self.run_id, accepted=False, reason="not authenticated"), conn
            )

"""Who may talk to a ROUTER of this run: a per-run secret and the Hello proof built on it.

    session                          stage process (launched by the session)
      secret = new_secret()            reads the secret from its stdin JSON payload
      ROUTER bind (gated)              DEALER identity = connection_identity("reward/0")
                                       Hello(..., proof=proof(secret, run, stage, replica, ident))
      verify(...) with compare_digest  -> Channel.admit(ident, b"reward/0"), Welcome(accepted)
      anything else from an identity   -> header only, tensors dropped undecoded, refused

Why a random suffix on each connection's identity: a ZeroMQ ROUTER ignores a second
connection that announces an identity already in use (unless ROUTER_HANDOVER, which would
let anyone take over an accepted identity later). A squatter that connected first as
`reward/0` would then lock the real stage out. With `reward/0#<random>` nobody can guess
the identity a stage will use, and the ROUTER maps it to the name `reward/0` only after
the proof checks out (`Channel.admit`).

Invariants: the secret never appears on a command line, in the environment or in a file
(the launcher writes it to the child's stdin pipe); a proof binds one run, one
stage/replica and one connection identity, so it is worthless for any other connection;
proofs are compared in constant time. What a local process without the secret can still
do: connect and be refused (each Hello costs the owner one HMAC; its other messages are
dropped after their header is validated).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

SECRET_BYTES = 32
_DOMAIN = b"hybridflow-hello-v1"


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def connection_identity(name: str) -> bytes:
    """The socket identity of one connection of `name` ("reward/0"): unguessable."""
    return f"{name}#{secrets.token_hex(8)}".encode()


def proof(secret: bytes, run_id: str, stage: str, replica: int, ident: bytes) -> bytes:
    """HMAC-SHA256 over the length-prefixed fields (no two field lists share an encoding)."""
    mac = hmac.new(secret, _DOMAIN, hashlib.sha256)
    for field in (run_id.encode(), stage.encode(), str(replica).encode(), ident):
        mac.update(len(field).to_bytes(4, "big"))
        mac.update(field)
    return mac.digest()


def verify(
    secret: bytes, run_id: str, stage: str, replica: int, ident: bytes, given: bytes
) -> bool:
    if not secret:  # a run without a secret admits nobody
        return False
    return hmac.compare_digest(proof(secret, run_id, stage, replica, ident), given)

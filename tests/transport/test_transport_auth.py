"""A gated ROUTER (transport/auth.py, Channel.admit): what an unadmitted connection can
make it do over a real socket, and the proof that gets a peer admitted."""

from __future__ import annotations

import os

import pytest
import torch

from hybridflow.errors import PeerDeadError, ProtocolError, TransportTimeout
from hybridflow.transport import auth, protocol, shm
from hybridflow.transport.channel import Channel
from hybridflow.transport.protocol import (
    Heartbeat,
    Hello,
    Release,
    Result,
    ShmRef,
    TensorDesc,
    Welcome,
)
from hybridflow.transport.tensors import TensorCodec

_writers: dict[str, shm.ShmWriter] = {}


def _segment(run_id: str, nbytes: int = 4096) -> str:
    """A real one-shot segment of run `run_id`, as a stage of that run would create it."""
    data = torch.arange(nbytes // 4, dtype=torch.float32)
    writer = _writers.setdefault(run_id, shm.ShmWriter(run_id))
    return writer.write([(0, memoryview(data.numpy()).cast("B"))], nbytes)


def _naming(seg: str, nbytes: int = 4096, lease: int = 0) -> TensorDesc:
    where = ShmRef(name=seg, offset=0, segment_bytes=nbytes, lease=lease)
    return TensorDesc(name="x", dtype="float32", shape=[nbytes // 4], nbytes=nbytes, where=where)


def _mapped(seg: str) -> bool:
    with open("/proc/self/maps") as f:
        return seg in f.read()


def _result(run_id: str) -> Result:
    return Result(run_id=run_id, task_id=0, step=0, mb_id=0, policy_version=0, role="r", op="score")


async def test_unknown_identity_naming_a_real_segment_leaves_it_untouched(endpoint, run_id):
    router = Channel("router", endpoint, bind=True, gated=True, name="owner", run_id=run_id)
    # The outsider picks a name a real stage would use: that gains it nothing.
    outsider = Channel(
        "dealer", endpoint, bind=False, name="x", run_id=run_id, identity=b"reward/0"
    )
    seg, pooled = _segment(run_id), _segment(run_id)
    try:
        # Raw frames: the descriptors name segments the outsider did not create for us.
        for desc in (_naming(seg), _naming(pooled, lease=7)):
            assert outsider._try_send(protocol.encode(_result(run_id), [desc]))
        assert outsider._try_send(protocol.encode(Release(ids=[], segments=[pooled])))
        await outsider.send(Heartbeat(stage="reward", replica=0, seq=1))
        rx = await router.recv(timeout=10)
        # Only the tensor-less message comes through, marked untrusted, under its raw
        # connection identity; the ones naming segments were dropped after the header.
        assert isinstance(rx.msg, Heartbeat) and not rx.trusted and rx.peer == b"reward/0"
        assert router.untrusted_dropped == 3
        for name in (seg, pooled):
            assert os.path.exists(f"/dev/shm/{name}"), "unlinked"
            assert not _mapped(name), "mapped"
        # A send to its raw identity as if it were a stage is refused: names are admitted.
        with pytest.raises(PeerDeadError, match="not been admitted"):
            await router.send(Welcome(run_id=run_id, accepted=True), to=b"reward/0")
        # The refusal reply never waits.
        assert router.reply(Welcome(run_id=run_id, accepted=False, reason="no"), b"reward/0")
        got = await outsider.recv(timeout=10)
        assert isinstance(got.msg, Welcome) and not got.msg.accepted
    finally:
        router.close()
        outsider.close()
        shm.sweep_pid(run_id, os.getpid())


async def test_an_admitted_peer_is_known_by_its_name_whatever_its_connection(endpoint, run_id):
    secret = auth.new_secret()
    router = Channel("router", endpoint, bind=True, gated=True, name="owner", run_id=run_id)
    conn = auth.connection_identity("reward/0")
    stage = Channel("dealer", endpoint, bind=False, name="s", run_id=run_id, identity=conn)
    try:
        hello = Hello(
            stage="reward", replica=0, pid=os.getpid(), roles=[], config_hash="h",
            proof=auth.proof(secret, run_id, "reward", 0, conn),
        )  # fmt: skip
        await stage.send(hello)
        rx = await router.recv(timeout=10)
        assert not rx.trusted and rx.peer == conn
        assert isinstance(rx.msg, Hello)
        assert auth.verify(secret, run_id, "reward", 0, conn, rx.msg.proof)
        router.admit(conn, b"reward/0")
        await router.send(Welcome(run_id=run_id, accepted=True), to=b"reward/0")
        assert isinstance((await stage.recv(timeout=10)).msg, Welcome)
        # Now its tensors are decoded (through shared memory too), under its name.
        await stage.send(_result(run_id), {"x": torch.arange(1 << 19, dtype=torch.float32)})
        rx = await router.recv(timeout=10)
        assert rx.trusted and rx.peer == b"reward/0"
        assert torch.equal(rx.tensors["x"], torch.arange(1 << 19, dtype=torch.float32))
    finally:
        router.close()
        stage.close()


def test_a_proof_binds_run_stage_replica_and_connection():
    secret, conn = auth.new_secret(), b"reward/0#ab"
    good = auth.proof(secret, "run1", "reward", 0, conn)
    assert auth.verify(secret, "run1", "reward", 0, conn, good)
    assert not auth.verify(secret, "run2", "reward", 0, conn, good)
    assert not auth.verify(secret, "run1", "actor", 0, conn, good)
    assert not auth.verify(secret, "run1", "reward", 1, conn, good)
    assert not auth.verify(secret, "run1", "reward", 0, b"reward/0#ac", good)
    assert not auth.verify(auth.new_secret(), "run1", "reward", 0, conn, good)
    assert not auth.verify(
        b"", "run1", "reward", 0, conn, auth.proof(b"", "run1", "reward", 0, conn)
    )
    # Length-prefixed fields: moving bytes between fields changes the proof.
    assert auth.proof(secret, "ab", "c", 0, conn) != auth.proof(secret, "a", "bc", 0, conn)
    assert auth.connection_identity("reward/0") != auth.connection_identity("reward/0")


def test_a_segment_of_another_run_is_never_opened(run_id):
    other = _segment("someone-else")
    try:
        codec = TensorCodec(run_id=run_id)
        with pytest.raises(ProtocolError, match="is not one of run"):
            codec.decode([_naming(other)], [], None)
        assert os.path.exists(f"/dev/shm/{other}") and not _mapped(other)
    finally:
        shm.sweep("someone-else")


async def test_recv_of_only_dropped_messages_times_out(endpoint, run_id):
    router = Channel("router", endpoint, bind=True, gated=True, name="owner", run_id=run_id)
    outsider = Channel("dealer", endpoint, bind=False, name="x", run_id=run_id)
    seg = _segment(run_id)
    try:
        assert outsider._try_send(protocol.encode(_result(run_id), [_naming(seg)]))
        with pytest.raises(TransportTimeout):
            await router.recv(timeout=0.5)
        assert router.untrusted_dropped == 1 and os.path.exists(f"/dev/shm/{seg}")
    finally:
        router.close()
        outsider.close()
        shm.sweep_pid(run_id, os.getpid())

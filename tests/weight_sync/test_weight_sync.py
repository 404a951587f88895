"""Weight sync without stage processes: what the topology implies (links, barrier
partners, endpoints, errors) and the two ends over real ZeroMQ sockets in one event loop
(order, window, acks, errors, the NCCL tier's code over gloo)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from typing import Any

import pytest
import torch
from ws_helpers import disaggregated

from hybridflow.config.schema import load_topology
from hybridflow.errors import ConfigError, PeerDeadError, PipelineError, TransportTimeout
from hybridflow.pipeline.host.weight_stream import WINDOW, WeightReceiver, WeightSender
from hybridflow.pipeline.host.weight_sync import endpoints
from hybridflow.pipeline.plan.planner import build_plan, describe, describe_text
from hybridflow.pipeline.plan.weight_links import identity, links, sync_partners
from hybridflow.transport import auth
from hybridflow.transport.channel import Channel
from hybridflow.transport.protocol import Hello, Weights

RESHARD, LOAD = 5, 6  # dataflow indices in ws_helpers.disaggregated
SECRET = auth.new_secret()


def _colocated(d: dict[str, Any]) -> dict[str, Any]:
    """The same run with the rollout in the actor's process (the hybrid engine)."""
    d["stages"]["trainer"]["roles"]["rollout"] = d["stages"].pop("gen")["roles"]["rollout"]
    d["dataflow"] = [op for op in d["dataflow"] if op["op"] != "load_weights"]
    return d


def test_link_is_derived_from_where_roles_live(tmp_path):
    topo = load_topology(disaggregated(tmp_path))
    (link,) = links(topo)
    assert (link.source, link.source_stage, link.targets) == ("actor", "trainer", ("rollout",))
    assert link.receivers == (("rollout", "gen", 0),) and link.tier == "shm"
    assert (link.reshard_op, link.load_ops, link.local_too) == (RESHARD, (LOAD,), False)
    # The two ops of the link run together; each still waits for everything before it.
    plan = build_plan(topo)
    assert plan.ops[LOAD].deps == tuple(range(RESHARD))
    assert plan.ops[RESHARD].deps == tuple(range(RESHARD))
    assert describe(plan)["weight_sync"] == [
        {"from": "actor (trainer/0)", "to": ["rollout (gen/0)"], "tier": "shm"}
    ]
    assert "weights: actor (trainer/0) -> rollout (gen/0) over shm" in describe_text(plan)

    colocated = load_topology(_colocated(disaggregated(tmp_path)))
    assert links(colocated) == () and sync_partners(colocated) == {}
    assert "weight_sync" not in describe(build_plan(colocated))


def test_cuda_everywhere_picks_nccl_and_replicas_all_receive(tmp_path):
    d = disaggregated(tmp_path)
    d["stages"]["trainer"]["devices"] = "cuda:0"
    d["stages"]["gen"].update(replicas=2, devices=["cuda:1", "cuda:2"])
    (link,) = links(load_topology(d))
    assert link.tier == "nccl"
    assert link.identities == (b"rollout@gen/0", b"rollout@gen/1")
    d["stages"]["gen"]["devices"] = ["cuda:1", "cpu"]
    assert links(load_topology(d))[0].tier == "shm"  # one CPU end: shared memory


def test_a_load_without_inputs_needs_a_reshard_in_another_stage(tmp_path):
    d = _colocated(disaggregated(tmp_path))
    d["dataflow"].append({"role": "rollout", "op": "load_weights", "scope": "step"})
    with pytest.raises(
        ConfigError,
        match=r"dataflow\[6\].*no inputs.*dataflow\[5\] actor.reshard runs in the same stage",
    ):
        build_plan(load_topology(d))


def test_endpoints_live_in_the_run_ipc_dir_or_on_free_tcp_ports(tmp_path):
    topo = load_topology(disaggregated(tmp_path))
    listeners: list[socket.socket] = []
    assert endpoints(topo, "ipc:///tmp/hf-x/coordinator", listeners) == {
        "actor": {"stage": "trainer", "endpoint": "ipc:///tmp/hf-x/weights-actor", "nccl_port": 0}
    }
    assert listeners == []
    try:
        spec = endpoints(topo, "tcp://127.0.0.1:5555", listeners)["actor"]
        tcp = spec["endpoint"]
        assert tcp.startswith("tcp://127.0.0.1:") and not tcp.endswith(":5555")
        # The port is held by a socket that stays bound and listening (no close-rebind
        # window): the sending process adopts this very fd.
        (sock,) = listeners
        assert spec["listen_fd"] == sock.fileno()
        assert tcp == f"tcp://127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(OSError):  # nobody else can bind it meanwhile
            socket.create_server(("127.0.0.1", sock.getsockname()[1]))
    finally:
        for sock in listeners:
            sock.close()


# ---------------------------------------------------------------------------------------
# The two ends, in one event loop


def _buckets(version: int, n: int = 6) -> list[dict[str, torch.Tensor]]:
    return [
        {
            f"layer{i}.w": torch.full((300, 50), float(version * 100 + i)),
            f"layer{i}.ids": torch.arange(5, dtype=torch.int64) + i,
            f"layer{i}.flag": torch.tensor([True, False]),
        }
        for i in range(n)
    ]


async def _sync(
    sender: WeightSender,
    receivers: list[WeightReceiver],
    version: int,
    *,
    delay: float = 0.0,
    timeout: float = 30.0,
) -> list[list[tuple[dict[str, torch.Tensor], bool, int]]]:
    sent = iter(_buckets(version))
    got: list[list[tuple[dict[str, torch.Tensor], bool, int]]] = [[] for _ in receivers]

    async def next_bucket() -> dict[str, torch.Tensor] | None:
        return next(sent, None)

    def loader(i: int):
        async def load(bucket, last, v):
            got[i].append(({k: t.clone() for k, t in bucket.items()}, last, v))
            await asyncio.sleep(delay)
            return {"loaded": 1.0}

        return load

    await asyncio.gather(
        sender.push(next_bucket, version, timeout=timeout),
        *(r.pull(loader(i), timeout=timeout) for i, r in enumerate(receivers)),
    )
    return got


def _pair(tmp_path, n: int = 1, **kw: Any) -> tuple[WeightSender, list[WeightReceiver]]:
    ep = f"ipc://{tmp_path}/w"
    ids = tuple(identity("rollout", "gen", r) for r in range(n))
    sender = WeightSender("ws", ep, ids, run_id="wsunit", config_hash="h", secret=SECRET, **kw)
    receivers = [
        WeightReceiver(
            f"wr{r}", ep, ids[r], stage="gen", replica=r, role="rollout", run_id="wsunit",
            config_hash="h", secret=SECRET, rank=1 + r, world_size=1 + n, **kw,
        )
        for r in range(n)
    ]  # fmt: skip
    return sender, receivers


async def test_buckets_arrive_in_order_to_every_replica_within_the_window(tmp_path, shm_clean):
    sender, receivers = _pair(tmp_path, n=2)
    sender.start()
    try:
        for r in receivers:
            await r.start()
        for version in (1, 2):  # the second sync reuses the pooled segments
            got = await _sync(sender, receivers, version, delay=0.02)
            for per_receiver in got:
                assert [last for _, last, _ in per_receiver] == [False] * 5 + [True]
                assert {v for _, _, v in per_receiver} == {version}
                for (bucket, _, _), want in zip(per_receiver, _buckets(version), strict=True):
                    assert bucket.keys() == want.keys()
                    assert all(torch.equal(bucket[k], want[k]) for k in want)
            # Slow loads: the sender ran ahead exactly as far as the window allows.
            assert sender.max_unacked == WINDOW
            assert sender.acked == {r: 6 for r in sender.receivers}
    finally:
        await sender.close()
        for r in receivers:
            await r.close()


async def test_out_of_order_bucket_is_an_error_not_a_partial_load(tmp_path, shm_clean):
    ep = f"ipc://{tmp_path}/w"
    fake = Channel("router", ep, bind=True, name="fake sender", run_id="wsunit")
    receiver = WeightReceiver(
        "wr", ep, b"r0", stage="gen", replica=0, role="rollout", run_id="wsunit",
        config_hash="h", secret=SECRET,
    )  # fmt: skip
    try:
        await receiver.start()
        hello = await fake.recv(timeout=10)
        assert isinstance(hello.msg, Hello) and hello.msg.pid == os.getpid()
        await fake.send(Weights(policy_version=3, bucket=1, last=True), to=hello.peer)
        loaded = []

        async def load(bucket, last, version):
            loaded.append(bucket)
            return {}

        with pytest.raises(PipelineError, match="got bucket 1 of version 3, expected bucket 0"):
            await receiver.pull(load, timeout=10)
        assert loaded == []
        with pytest.raises(TransportTimeout, match=r"dataflow\[6\]\.params\.sync_timeout_s"):
            await receiver.pull(load, timeout=0.2, setting="dataflow[6].params.sync_timeout_s")
    finally:
        fake.close()
        await receiver.close()


async def test_a_receiver_that_dies_mid_sync_ends_the_push_with_its_name(tmp_path, shm_clean):
    ep = f"ipc://{tmp_path}/w"
    ident = identity("rollout", "gen", 0)
    sender = WeightSender(
        "weights actor->rollout", ep, (ident,), run_id="wsunit", config_hash="h", secret=SECRET
    )
    sender.start()
    # A peer that says hello with the pid of a process that has exited, then goes silent.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    conn = ident + b"#1"
    fake = Channel("dealer", ep, bind=False, name="fake receiver", run_id="wsunit", identity=conn)
    try:
        hello = Hello(
            stage="gen", replica=0, pid=gone.pid, roles=["rollout"], config_hash="h",
            proof=auth.proof(SECRET, "wsunit", "gen", 0, conn),
        )  # fmt: skip
        await fake.send(hello)
        buckets = iter(_buckets(1))

        async def next_bucket():
            return next(buckets, None)

        with pytest.raises(PeerDeadError, match=rf"rollout@gen/0 \(pid {gone.pid}\) died"):
            await sender.push(next_bucket, 1, timeout=30)
    finally:
        fake.close()
        await sender.close()


async def test_nccl_tier_code_over_gloo_moves_every_dtype(tmp_path):
    """The NCCL path (private group, NcclRef descriptors, posted sends) runs here over
    gloo; on GPUs the same code runs over NCCL (tier "nccl", not run on this machine)."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed without gloo")
    # The rendezvous port is a listening socket the sender's TCPStore adopts (as the
    # session hands it over): never closed and re-bound.
    listener = socket.create_server(("127.0.0.1", 0))
    sender, (receiver,) = _pair(tmp_path, tier="gloo", nccl_port=listener.getsockname()[1])
    sender.nccl_listen_fd = listener.fileno()
    sender.start()
    try:
        await receiver.start()
        for version in (1, 2):
            (got,) = await _sync(sender, [receiver], version)
            for (bucket, _, _), want in zip(got, _buckets(version), strict=True):
                assert all(torch.equal(bucket[k], want[k]) for k in want)
        assert sender._tier is not None and sender._tier.in_flight() == 0
    finally:
        await sender.close()
        await receiver.close()
        listener.close()

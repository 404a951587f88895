"""The NCCL tier's protocol on CPU: the same NcclGroup/NcclTier code over gloo, between
two real processes. Checks what does not depend on GPUs: rendezvous, one communicator per
direction, posting sends only after the header left, seq order, bidirectional streaming,
every dtype bit-exact. (NCCL itself is covered by test_transport_gpu.py on GPU machines.)"""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch
import transport_peers as peers

from hybridflow.errors import ProtocolError
from hybridflow.transport.channel import Channel
from hybridflow.transport.protocol import NcclRef, Result, Shutdown, Task, TensorDesc
from hybridflow.transport.tensors import DTYPES


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.contiguous(), b.contiguous()
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = {}
    for name, dt in DTYPES.items():
        if dt == torch.bool:
            t = torch.randint(0, 2, (7, 3), generator=g).bool()
        else:
            t = torch.randint(0, 256, (21 * dt.itemsize,), dtype=torch.uint8, generator=g)
            t = t.view(dt).reshape(7, 3)
        out[name] = t
        out[f"{name}_0d"] = t[1, 1].clone()
    out["noncontig"] = torch.arange(600.0).reshape(20, 30).t()[::2]
    out["big"] = torch.randn(1 << 21)  # 8 MiB
    out["empty"] = torch.empty(0, 4)
    return out


def _task(i: int, op: str) -> Task:
    return Task(run_id="n", task_id=i, step=0, mb_id=0, policy_version=0, role="r", op=op)


async def test_nccl_tier_protocol_over_gloo_between_processes(
    endpoint: str, run_id: str, spawn
) -> None:
    from hybridflow.transport.nccl import NcclGroup, NcclTier

    port = _free_port()
    child = spawn(peers.nccl_echo, port, endpoint, "gloo")
    loop = asyncio.get_running_loop()
    group = await loop.run_in_executor(
        None, lambda: NcclGroup(0, 2, master_port=port, device="cpu", backend="gloo")
    )
    assert sorted(group._to) == [1] and sorted(group._from) == [1]  # one per direction
    tier = NcclTier(group, rank_of={peers.ECHO_ID: 1})
    ch = Channel("router", endpoint, bind=True, name="rank0", run_id=run_id, cuda=tier)
    try:
        await ch.recv(timeout=120)  # hello
        sent = _cases()
        bumpable = {k: v for k, v in sent.items() if v.dtype in (torch.int32, torch.float32)}
        plan = [("echo", sent), ("add_one", bumpable), ("echo", sent), ("add_one", bumpable)]
        for i, (op, tensors) in enumerate(plan):  # streamed: both directions busy at once
            await ch.send(_task(i, op), tensors, to=peers.ECHO_ID, timeout=60)
        for i, (op, tensors) in enumerate(plan):
            got = await ch.recv(timeout=120)
            assert isinstance(got.msg, Result) and got.msg.task_id == i
            want = tensors if op == "echo" else {k: peers.bump(v) for k, v in tensors.items()}
            bad = [k for k, v in want.items() if not _same(v, got.tensors[k])]
            assert not bad, f"{op} #{i}: not bit-exact: {bad}"
        # Every non-empty tensor went through the tier, both ways (not through frames/shm).
        through = sum(sum(1 for v in t.values() if v.numel()) for _, t in plan)
        assert tier._next_seq[1] == through  # sends to rank 1
        assert tier._last_seen[1] == through - 1  # receives from rank 1, seq 0..through-1
        # A descriptor whose seq goes backwards is refused, not matched with the wrong bytes.
        stale = TensorDesc(
            name="x", dtype="float32", shape=[2], nbytes=8, where=NcclRef(src=1, seq=0, device=0)
        )
        with pytest.raises(ProtocolError, match="out of order"):
            tier.import_(stale, peers.ECHO_ID)
        await ch.send(Shutdown(), to=peers.ECHO_ID, timeout=10)
        await loop.run_in_executor(None, child.join, 60)
        assert child.exitcode == 0
    finally:
        ch.close()
        group.close()

"""Tiers 1-2: every dtype and awkward shape crosses real sockets between two processes
bit-exact; pooled segments are never overwritten while a receiver still holds them;
nothing is left in /dev/shm."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch
import transport_peers as peers

from hybridflow.transport.channel import Channel
from hybridflow.transport.protocol import Result, Shutdown, Task
from hybridflow.transport.tensors import DTYPES

THRESHOLD = 1 << 16  # small, so that moderately sized tensors take the shm tier


def _rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)  # every bit pattern, NaNs and subnormals included


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for name, dt in DTYPES.items():
        out[f"{name}_small"] = _rand((3, 5), dt, g)
        out[f"{name}_0d"] = _rand((), dt, g)
        out[f"{name}_big"] = _rand((THRESHOLD // dt.itemsize + 7,), dt, g)  # tier 2
    out["empty"] = torch.empty(0)
    out["empty_3d"] = torch.empty(3, 0, 2, dtype=torch.bfloat16)
    out["transposed"] = _rand((64, 48), torch.float32, g).t()
    out["stepped"] = _rand((200, 100), torch.bfloat16, g)[::3, 1::2]
    out["expanded"] = torch.arange(4.0).expand(1000, 4)  # stride 0: 16 KB of real bytes
    out["bool_noncontig_big"] = _rand((600, 300), torch.bool, g)[:, ::2]
    out["bf16_noncontig_big"] = _rand((512, 512), torch.bfloat16, g).t()
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a8 = a.contiguous().reshape(-1).view(torch.uint8)
    b8 = b.contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(a8, b8)


def _task(i: int = 0, op: str = "echo") -> Task:
    return Task(run_id="t", task_id=i, step=0, mb_id=0, policy_version=0, role="r", op=op)


@pytest.mark.parametrize("pattern", ["router_dealer", "push_pull"])
async def test_every_dtype_and_shape_round_trips_between_processes(
    pattern: str, endpoint: str, run_id: str, spawn
) -> None:
    sent = _cases()
    if pattern == "router_dealer":
        out = inbox = Channel(
            "router", endpoint, bind=True, name="parent", run_id=run_id, shm_threshold=THRESHOLD
        )
        child = spawn(peers.echo, endpoint, "dealer", run_id)
        hello = await inbox.recv(timeout=120)
        to: bytes | None = hello.peer
    else:
        out = Channel(
            "push", endpoint, bind=True, name="out", run_id=run_id, shm_threshold=THRESHOLD
        )
        inbox = Channel("pull", endpoint + ".back", bind=True, name="in", run_id=run_id)
        child = spawn(peers.echo, endpoint, "pull", run_id)
        await inbox.recv(timeout=120)  # hello: the child is up
        to = None
    try:
        # Several messages: tier-2 segments get reused (pooled) or made anew (one-shot).
        for i in range(3):
            await out.send(_task(i), sent, to=to, timeout=120)
            got = await inbox.recv(timeout=120)
            assert isinstance(got.msg, Result) and got.msg.task_id == i
            assert set(got.tensors) == set(sent)
            bad = [k for k, t in sent.items() if not _same(t, got.tensors[k])]
            assert not bad, f"not bit-exact: {bad}"
            for k, t in got.tensors.items():
                assert t.is_contiguous(), k
                if t.numel() and t.dtype in (torch.float32, torch.int64):
                    t.add_(1)  # writable, no warning
            del got
            gc.collect()
        await out.send(Shutdown(), to=to, timeout=60)
        await asyncio.get_running_loop().run_in_executor(None, child.join, 60)
        assert child.exitcode == 0
    finally:
        out.close()
        inbox.close()
    assert peers.shm_names(run_id) == []


async def test_pooled_segment_is_not_reused_while_the_receiver_holds_it(
    endpoint: str, run_id: str
) -> None:
    kw = {"run_id": run_id, "shm_pool_bytes": 8 << 20}
    with (
        Channel("router", endpoint, bind=True, name="rx", **kw) as rx,
        Channel("dealer", endpoint, bind=False, name="tx", identity=b"tx", **kw) as tx,
    ):
        held = []
        for i in range(6):  # 6 x 2 MiB held > 8 MiB pool: the rest go one-shot
            await tx.send(_task(i), {"x": torch.full((1 << 19,), i, dtype=torch.float32)})
            held.append((await rx.recv(timeout=10)).tensors["x"])
        assert tx.codec.shm_pool_in_flight() == 4
        for i, t in enumerate(held):
            assert torch.all(t == i), f"message {i} was overwritten while held"
        del held, t
        gc.collect()
        # Acks flow back on the next operation of the receiving side.
        await rx.send(_task(99), to=b"tx")
        assert (await tx.recv(timeout=10)).msg.task_id == 99
        assert tx.codec.shm_pool_in_flight() == 0
        for i in range(3):  # reuse: same pooled segments, fresh contents
            await tx.send(_task(i), {"x": torch.full((1 << 19,), -i, dtype=torch.float32)})
            got = await rx.recv(timeout=10)
            assert torch.all(got.tensors["x"] == -i)
            del got
            gc.collect()
    assert peers.shm_names(run_id) == []


async def test_cuda_tensor_without_a_cuda_tier_is_staged_through_cpu(
    endpoint: str, run_id: str
) -> None:
    # On a CPU machine this is the CPU path; with CUDA it checks the staging fallback.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with (
        Channel("push", endpoint, bind=True, name="tx", run_id=run_id) as tx,
        Channel("pull", endpoint, bind=False, name="rx", run_id=run_id) as rx,
    ):
        x = torch.arange(10, device=dev)
        await tx.send(_task(), {"x": x}, timeout=5)
        got = await rx.recv(timeout=5)
        assert got.tensors["x"].device.type == "cpu"
        assert torch.equal(got.tensors["x"], x.cpu())

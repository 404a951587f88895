"""The bench's stage process: a DEALER per coordinator channel that answers as told.

Spawned by `StageProc` (measure.py), it connects to each of the coordinator's ROUTERs,
says Hello, then serves: Ping -> Pong (rtt), Task `echo` -> the tensors back (frame
round trip), `verify` -> checksums of what it got, `sink` -> an ack once it holds the
tensors, `stream` -> one ack after `count` messages (nccl), `raw_recv` -> a plain NCCL
receive loop (the nccl baseline). Shutdown ends it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import torch

from hybridflow.transport import aio
from hybridflow.transport.channel import Channel
from hybridflow.transport.protocol import Hello, Ping, Pong, Result, Shutdown, Task

MiB = 1 << 20
STAGE_ID = b"bench-stage"


def payload(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[nbytes] uint8 of varied bytes, made fast (a random MiB tiled)."""
    block = torch.randint(0, 256, (min(nbytes, MiB),), dtype=torch.uint8)
    reps = -(-nbytes // block.numel())
    return block.repeat(reps)[:nbytes].contiguous().to(device)


def checksum(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    out = {}
    for name, t in tensors.items():
        b = t.detach().contiguous().reshape(-1)
        b = b.view(torch.uint8) if b.dtype != torch.bool else b.to(torch.uint8)
        out[name] = float(b.sum(dtype=torch.int64).item())  # exact below 2**53
    return out


def stage_main(endpoints: dict[str, str], gpu: dict[str, Any] | None) -> None:
    aio.run(_stage(endpoints, gpu))


async def _stage(endpoints: dict[str, str], gpu: dict[str, Any] | None) -> None:
    group = None
    cuda = None
    if gpu is not None:
        torch.cuda.set_device(gpu["device"])
        if gpu["tier"] == "nccl":
            from hybridflow.transport.nccl import NcclGroup, NcclTier

            group = NcclGroup(1, 2, master_port=gpu["port"], device=gpu["device"])
            cuda = NcclTier(group, rank_of=0)
        else:
            from hybridflow.transport.cuda_ipc import CudaIpcTier

            cuda = CudaIpcTier()
    chans = [
        Channel(
            "dealer",
            ep,
            bind=False,
            name=f"stage-{key}",
            run_id="bench",  # the coordinator side's: shm names carry the run's prefix
            identity=STAGE_ID,
            cuda=cuda,
        )
        for key, ep in endpoints.items()
    ]
    for ch in chans:
        await ch.send(Hello(stage="bench", replica=0, pid=os.getpid(), roles=[], config_hash=""))
    stop = asyncio.Event()
    try:
        serving = [asyncio.create_task(_serve(ch, group, stop), name=ch.name) for ch in chans]
        await stop.wait()
        for task in serving:
            task.cancel()
        await asyncio.gather(*serving, return_exceptions=True)
    finally:
        for ch in chans:
            ch.close()
        if group is not None:
            group.close()


async def _serve(ch: Channel, group: Any, stop: asyncio.Event) -> None:
    streamed = 0
    while True:
        r = await ch.recv()
        if isinstance(r.msg, Shutdown):
            stop.set()
            return
        if isinstance(r.msg, Ping):
            await ch.send(Pong(seq=r.msg.seq, t_ns=r.msg.t_ns))
            continue
        if not isinstance(r.msg, Task):
            continue
        t = r.msg
        metrics: dict[str, float] = {}
        if t.op == "echo":
            await ch.send(_result(t), r.tensors)
            continue
        if t.op == "verify":
            metrics = checksum(r.tensors)
        elif t.op == "stream":  # ack only the last of `count` messages
            streamed += 1
            if streamed < int(t.params.get("count", 1)):  # type: ignore[arg-type]
                continue
            streamed = 0
            torch.cuda.synchronize()
        elif t.op == "raw_recv" and group is not None:
            n, count = int(t.params["nbytes"]), int(t.params["count"])  # type: ignore[arg-type]
            buf = torch.empty(n, dtype=torch.uint8, device=group.device)
            for _ in range(count):
                group.irecv(buf, 0).wait()
            torch.cuda.synchronize()
        del r  # drop the received tensors before acking: their leases go back first
        await ch.send(_result(t, metrics))


def _result(t: Task, metrics: dict[str, float] | None = None) -> Result:
    return Result(
        run_id=t.run_id,
        task_id=t.task_id,
        step=t.step,
        mb_id=t.mb_id,
        policy_version=t.policy_version,
        role=t.role,
        op=t.op,
        metrics=metrics or {},
    )


def make_task(op: str, i: int = 0, **params: Any) -> Task:
    return Task(
        run_id="bench",
        task_id=i,
        step=0,
        mb_id=0,
        policy_version=0,
        role="bench",
        op=op,
        params=params,
    )

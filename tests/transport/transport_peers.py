"""Peer processes for the transport tests (spawned: real processes, real sockets).

Each entry point runs its own event loop and talks to the test process over a real
ZeroMQ endpoint; nothing is faked.
"""

from __future__ import annotations

import asyncio
import os
import time

import torch

from hybridflow.transport import aio
from hybridflow.transport.channel import Channel
from hybridflow.transport.liveness import Heartbeater
from hybridflow.transport.protocol import Hello, Result, Shutdown, Task

ECHO_ID = b"echo-peer"


def shm_names(run_id: str) -> list[str]:
    """This run's segments currently in /dev/shm."""
    from hybridflow.transport.shm import run_prefix

    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(run_prefix(run_id)))


def result_for(t: Task, **metrics: float) -> Result:
    return Result(
        run_id=t.run_id,
        task_id=t.task_id,
        step=t.step,
        mb_id=t.mb_id,
        policy_version=t.policy_version,
        role=t.role,
        op=t.op,
        metrics=metrics,
    )


def bump(t: torch.Tensor) -> torch.Tensor:
    """A value-changing op for every dtype (new memory, same device)."""
    return ~t if t.dtype == torch.bool else t + 1


def hello() -> Hello:
    return Hello(stage="peer", replica=0, pid=os.getpid(), roles=[], config_hash="test")


def echo(endpoint: str, kind: str, run_id: str, cuda: str = "", device: int = 0) -> None:
    """Echo every Task's tensors back (DEALER: to the ROUTER; PULL: on `endpoint`+'.back')."""
    aio.run(_echo(endpoint, kind, run_id, cuda, device))


async def _echo(endpoint: str, kind: str, run_id: str, cuda: str, device: int) -> None:
    tier = None
    if cuda == "ipc":
        from hybridflow.transport.cuda_ipc import CudaIpcTier

        torch.cuda.set_device(device)
        tier = CudaIpcTier()
    if kind == "dealer":
        inbox = outbox = Channel(
            "dealer", endpoint, bind=False, name="echo", run_id=run_id, identity=ECHO_ID, cuda=tier
        )
        await outbox.send(hello())
    else:
        inbox = Channel("pull", endpoint, bind=False, name="echo-in", run_id=run_id)
        outbox = Channel("push", endpoint + ".back", bind=False, name="echo-out", run_id=run_id)
        await outbox.send(hello())  # "I am up": start-up time is not the test's business
    kept = []
    try:
        while True:
            r = await inbox.recv()
            if isinstance(r.msg, Shutdown):
                return
            if isinstance(r.msg, Task):
                tensors = r.tensors
                if r.msg.op == "add_one":  # prove the receiver got usable tensors
                    tensors = {k: bump(v) for k, v in tensors.items()}
                elif r.msg.op == "hold":  # keep them (never ack) and answer without them
                    kept.append(tensors)
                    tensors = {}
                await outbox.send(result_for(r.msg), tensors)
                del r, tensors
    finally:
        inbox.close()
        outbox.close()


def streaming_sender(endpoint: str, run_id: str, mib: int, heartbeat_s: float) -> None:
    """Say hello, heartbeat, and stream large CPU tensors until killed. One-shot segments
    (no pool), so that messages still queued in this process when it dies name segments
    nobody will ever open: only a sweep by pid can remove those."""
    aio.run(_streaming_sender(endpoint, run_id, mib, heartbeat_s))


async def _streaming_sender(endpoint: str, run_id: str, mib: int, heartbeat_s: float) -> None:
    ch = Channel(
        "dealer", endpoint, bind=False, name="streamer", run_id=run_id, hwm=4, shm_pool_bytes=0
    )
    await ch.send(hello())
    Heartbeater(ch, stage="streamer", replica=3, interval_s=heartbeat_s).start()
    x = torch.arange(mib * (1 << 20) // 4, dtype=torch.int32)
    i = 0
    while True:
        await ch.send(_task(i), {"x": x})
        i += 1
        await asyncio.sleep(0)


def silent_receiver(endpoint: str, run_id: str, heartbeat_s: float) -> None:
    """Connect, say hello, heartbeat, hold every received tensor (never ack), until killed."""
    aio.run(_silent_receiver(endpoint, run_id, heartbeat_s))


async def _silent_receiver(endpoint: str, run_id: str, heartbeat_s: float) -> None:
    ch = Channel("dealer", endpoint, bind=False, name="hoarder", run_id=run_id)
    await ch.send(hello())
    Heartbeater(ch, stage="hoarder", replica=0, interval_s=heartbeat_s).start()
    kept = []
    while True:
        r = await ch.recv()
        kept.append(r.tensors)  # never released: the sender must clean up when we die
        await ch.send(result_for(r.msg) if isinstance(r.msg, Task) else hello())


def _task(i: int, op: str = "echo") -> Task:
    return Task(
        run_id="t", task_id=i, step=0, mb_id=i, policy_version=0, role="r", op=op, params={}
    )


def nccl_echo(port: int, endpoint: str, backend: str = "nccl") -> None:
    """Rank 1 (cuda:1, or CPU over gloo): receive tensors through the NCCL tier, send them
    back the same way (bumped for add_one)."""
    aio.run(_nccl_echo(port, endpoint, backend))


async def _nccl_echo(port: int, endpoint: str, backend: str) -> None:
    from hybridflow.transport.nccl import NcclGroup, NcclTier

    device = 1 if backend == "nccl" else "cpu"
    group = NcclGroup(1, 2, master_port=port, device=device, backend=backend)
    ch = Channel(
        "dealer", endpoint, bind=False, name="nccl-echo", identity=ECHO_ID,
        cuda=NcclTier(group, rank_of=0),
    )  # fmt: skip
    await ch.send(hello())
    try:
        while True:
            r = await ch.recv()
            if isinstance(r.msg, Shutdown):
                return
            if isinstance(r.msg, Task):
                tensors = r.tensors
                if r.msg.op == "add_one":
                    tensors = {k: bump(v) for k, v in tensors.items()}
                devices = {k: float(v.device.index or 0) for k, v in tensors.items()}
                await ch.send(result_for(r.msg, **devices), tensors)
    finally:
        if backend == "nccl":
            torch.cuda.synchronize()
        time.sleep(0.2)
        ch.close()
        group.close()

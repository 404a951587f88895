"""The GPU tensor tiers: `cuda_ipc` (tier 3, CUDA only: hand-off of a GPU tensor to
another process by handle) and `nccl` (tier 4, two GPUs: streamed NCCL transfers,
against a raw ProcessGroupNCCL send/recv loop of the same bytes between the same
processes).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import torch

from hybridflow.bench.transport.measure import StageProc, baselines, case, handoff, verify
from hybridflow.bench.transport.stage import STAGE_ID, MiB, make_task, payload
from hybridflow.transport.protocol import Hello


async def cuda_ipc_cases(s: dict[str, Any]) -> list[dict]:
    from hybridflow.transport.cuda_ipc import CudaIpcTier

    cases: list[dict] = []
    dev = torch.device("cuda", 0)
    async with StageProc({"ipc": {"cuda": CudaIpcTier()}}, gpu={"tier": "ipc", "device": 0}) as st:
        ch = st.chans["ipc"]
        for mib in s["gpu_sizes_mib"]:
            n = mib * MiB
            t = {"x": payload(n, dev)}
            await verify(ch, t)
            sec, base = await handoff(ch, t, s["reps"], "sink")
            cases.append(
                case(
                    "cuda_ipc",
                    n,
                    sec,
                    base,
                    handoff_us=round(sec * 1e6, 1),
                    what="hand-off to another process on the same GPU: send -> stage has "
                    "the tensor (zero-copy) -> ack; baseline: device-to-device copy",
                )
            )
            del t
    return cases


async def nccl_cases(s: dict[str, Any]) -> list[dict]:
    from hybridflow.transport.nccl import NcclGroup, NcclTier

    port = _free_port()
    cases: list[dict] = []
    dev = torch.device("cuda", 0)
    gpu = {"tier": "nccl", "device": 1, "port": port}
    # The stage joins the group from its process; ours joins once the stage is spawned.
    st = StageProc({"nccl": {}}, gpu=gpu)
    st.proc.start()
    loop = asyncio.get_running_loop()
    group = await loop.run_in_executor(None, lambda: NcclGroup(0, 2, master_port=port, device=dev))
    ch = st.chans["nccl"]
    ch.codec.cuda = NcclTier(group, rank_of={STAGE_ID: 1})
    try:
        hello = await ch.recv(timeout=180)
        assert isinstance(hello.msg, Hello)
        count = 8
        for mib in s["gpu_sizes_mib"]:
            n = mib * MiB
            x = payload(n, dev)
            await verify(ch, {"x": x})
            times, raw = [], []
            for rep in range(s["reps"] // 2 + 2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i in range(count):
                    await ch.send(make_task("stream", i, count=count), {"x": x}, to=STAGE_ID)
                await ch.recv(timeout=120)
                times.append((time.perf_counter() - t0) / count)
                t0 = time.perf_counter()
                await ch.send(make_task("raw_recv", nbytes=n, count=count), to=STAGE_ID)
                for _ in range(count):
                    group.isend(x, 1)
                await ch.recv(timeout=120)
                raw.append((time.perf_counter() - t0) / count)
                if rep < 2:
                    times.pop()
                    raw.pop()
            sec, raw_sec = statistics.median(times), statistics.median(raw)
            cases.append(
                case(
                    "nccl",
                    n,
                    sec,
                    (n / raw_sec / 1e9, baselines(x, s["reps"])[1]),
                    what=f"cuda:0 -> cuda:1, {count} messages streamed then one ack; "
                    "baseline: raw ProcessGroupNCCL send/recv loop of the same bytes between "
                    "the same processes (baseline_alloc_copy_gb_per_s: local clone on cuda:0)",
                )
            )
            del x
    finally:
        st.chans["nccl"].codec.cuda = None
        await st.__aexit__()
        group.close()
    return cases


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

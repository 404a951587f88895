"""`hybridflow bench transport --json`: what each transport tier costs, against a local copy.

Two processes, as in a run: this process is the coordinator (ROUTER, binds ipc://), a
spawned stage process connects (DEALER) and answers. Cases (one JSON object, `cases`):

  rtt        Ping -> Pong round trip, coordinator -> stage -> coordinator: rtt_us_p50/p99;
             raw_zmq_rtt_us_p50/p99: the same frames ping-ponged by plain blocking pyzmq
             ROUTER/DEALER sockets between two other processes, timed in blocks alternating
             with the channels' so that both see the same load (vs_raw_zmq = p50 / raw p50)
  frame      tier 1: a Task with tensors in ZeroMQ frames, stage acks: one-way hand-off
  shm        tier 2, pooled segments (ROUTER/DEALER with Release acks), stage acks
  shm_oneshot tier 2, a fresh segment per message (what PUSH/PULL or a full pool get)
  cuda_ipc   tier 3 (CUDA only): hand-off of a GPU tensor to another process, by handle
  nccl       tier 4 (2+ GPUs): streamed NCCL transfers; baseline = raw send/recv loop

Every case has `tier, bytes, seconds, gb_per_s, baseline_gb_per_s`: the baseline is a plain
in-process copy of the same bytes into an already-touched buffer (`dst.copy_(src)`),
measured in the same run (for 1 MiB and up, timed alternately with the hand-offs, so both
see the same load on a shared host); `baseline_alloc_copy_gb_per_s` adds the cost of
fresh memory (`src.clone()`). `seconds` is the median per message. Each size is verified
once (the stage returns a checksum of what it received) before it is timed.

Overrides (`--set`): rtt_iters, reps, sizes_mib, frame_kib, oneshot_mib, gpu_sizes_mib
(comma lists), cpu (0/1).

One tier per module: rtt.py (the round trip and its raw pyzmq reference), cpu.py (frame,
shm, shm_oneshot), gpu.py (cuda_ipc, nccl); stage.py is the spawned stage process,
measure.py the baselines, the hand-off timing and the case record they share.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Any

import torch

from hybridflow.bench.transport.cpu import cpu_cases
from hybridflow.bench.transport.gpu import cuda_ipc_cases, nccl_cases
from hybridflow.bench.transport.stage import MiB
from hybridflow.errors import ConfigError
from hybridflow.transport import aio


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    s: dict[str, Any] = {
        "rtt_iters": 2000 if quick else 10000,
        "reps": 5 if quick else 15,
        "sizes_mib": [1, 64] if quick else [1, 16, 64, 256, 1024],
        "frame_kib": [4, 64, 512] if quick else [4, 64, 256, 512],
        "oneshot_mib": [64] if quick else [64, 256],
        "gpu_sizes_mib": [1, 64, 1024] if quick else [1, 16, 256, 1024, 4096],
        "cpu": 1,  # 0: only the GPU tiers
    }
    for item in getattr(args, "overrides", None) or []:
        key, sep, value = item.partition("=")
        if not sep or key not in s:
            raise ConfigError(f"bench.transport.{key}", f"unknown override; known: {sorted(s)}")
        try:
            s[key] = [int(v) for v in value.split(",")] if isinstance(s[key], list) else int(value)
        except ValueError:
            raise ConfigError(
                f"bench.transport.{key}", f"expected integers, got {value!r}"
            ) from None
    return s


def run(args: argparse.Namespace) -> dict[str, Any]:
    s = _settings(args)
    t0 = time.perf_counter()
    cases = aio.run(cpu_cases(s)) if s["cpu"] else []
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skipped = []
    if gpus >= 1:
        cases += aio.run(cuda_ipc_cases(s))
    else:
        skipped.append("cuda_ipc: no CUDA device")
    if gpus >= 2:
        cases += aio.run(nccl_cases(s))
    else:
        skipped.append("nccl: needs two CUDA devices")
    return {
        "bench": "transport",
        "quick": bool(getattr(args, "quick", False)),
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
        },
        "settings": s,
        "cases": cases,
        "skipped": skipped,
        "targets": _targets(cases),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def _targets(cases: list[dict]) -> dict[str, Any]:
    """The issue's targets, checked against this run's numbers (informational)."""
    out: dict[str, Any] = {}
    rtt = [c for c in cases if c["tier"] == "rtt"]
    if rtt:
        out["rtt_p50_le_100us"] = rtt[0]["rtt_us_p50"] <= 100
        out["rtt_p50_le_1.5x_raw_zmq"] = rtt[0]["vs_raw_zmq"] <= 1.5
    big = [c for c in cases if c["tier"] == "shm" and c["bytes"] >= 64 * MiB]
    if big:
        out["shm_ge_0.7x_copy_at_64MiB_plus"] = all(c["vs_baseline"] >= 0.7 for c in big)
    nccl = [c for c in cases if c["tier"] == "nccl" and c["bytes"] >= 64 * MiB]
    if nccl:
        out["nccl_ge_0.8x_raw_at_64MiB_plus"] = all(c["vs_baseline"] >= 0.8 for c in nccl)
    ipc = [c["handoff_us"] for c in cases if c["tier"] == "cuda_ipc"]
    if ipc:
        out["cuda_ipc_handoff_us_min_max"] = [min(ipc), max(ipc)]
    return out

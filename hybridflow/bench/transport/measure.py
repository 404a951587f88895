"""What every tier's case is measured with: the copy baselines, the hand-off timing, the
case record, and `StageProc` (the spawned stage and the coordinator's channels to it).

A baseline is a plain in-process copy of the same bytes into an already-touched buffer
(`dst.copy_(src)`), measured in the same run (for 1 MiB and up, timed alternately with
the hand-offs, so both see the same load on a shared host); the alloc-copy baseline adds
the cost of fresh memory (`src.clone()`).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from hybridflow.bench.transport.stage import STAGE_ID, MiB, checksum, make_task, stage_main
from hybridflow.transport.channel import Channel
from hybridflow.transport.protocol import Hello, Result, Shutdown


class Copier:
    """The baseline: a plain in-process copy of `src`'s bytes into a touched buffer.

    Small copies are repeated until one timing is ~10 ms long (timer resolution)."""

    def __init__(self, src: torch.Tensor) -> None:
        self.src, self.dst = src, torch.empty_like(src)
        self.sync = torch.cuda.synchronize if src.is_cuda else None
        self.dst.copy_(src)
        fastest = min(self._time(1) for _ in range(5))  # one preempted copy must not decide
        self.inner = max(1, min(10000, int(0.01 / max(fastest, 1e-7))))

    def _time(self, n: int, fn: Callable[[], Any] | None = None) -> float:
        fn = fn or (lambda: self.dst.copy_(self.src))
        if self.sync:
            self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if self.sync:
            self.sync()
        return (time.perf_counter() - t0) / n

    def copy_s(self) -> float:
        return self._time(self.inner)

    def clone_s(self) -> float:
        return self._time(self.inner, self.src.clone)


def baselines(src: torch.Tensor, reps: int) -> tuple[float, float]:
    """(copy into a touched buffer, clone into fresh memory) in GB/s, for `src`'s bytes."""
    c = Copier(src)
    n = src.numel() * src.element_size()
    warm = statistics.median(c.copy_s() for _ in range(max(reps, 5)))
    fresh = statistics.median(c.clone_s() for _ in range(max(reps, 5)))
    return n / warm / 1e9, n / fresh / 1e9


def case(tier: str, nbytes: int, seconds: float, base: tuple[float, float], **extra: Any) -> dict:
    """`base`: (baseline GB/s, the same into fresh memory or another reference GB/s)."""
    gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    case = {
        "tier": tier,
        "bytes": nbytes,
        "seconds": seconds,
        "gb_per_s": round(gbps, 3),
        "baseline_gb_per_s": round(base[0], 3),
        "vs_baseline": round(gbps / base[0], 3) if base[0] else None,
        "baseline_alloc_copy_gb_per_s": round(base[1], 3),
    }
    case.update(extra)
    return case


async def handoff(
    ch: Channel, tensors: dict[str, torch.Tensor], reps: int, op: str
) -> tuple[float, tuple[float, float]]:
    """Median hand-off time (send -> the stage has the tensors -> its ack) and the
    baselines (GB/s) for the same bytes, timed alternately with the hand-offs so that
    both see the same machine (this host is shared: other work comes and goes)."""
    src = next(iter(tensors.values()))
    n = src.numel() * src.element_size()
    copier = Copier(src)
    alternate = n >= MiB  # small copies take microseconds: alternating only adds wake-ups
    times, copies, clones = [], [], []
    for i in range(reps + 2):  # two warm-ups: segment creation, first page touches
        t0 = time.perf_counter()
        await ch.send(make_task(op, i), tensors, to=STAGE_ID)
        await ch.recv(timeout=60, timeout_setting="bench rtt")
        if i >= 2:
            times.append(time.perf_counter() - t0)
            if alternate:
                copies.append(copier.copy_s())
                clones.append(copier.clone_s())
    if not alternate:
        copies = [copier.copy_s() for _ in range(max(reps, 5))]
        clones = [copier.clone_s() for _ in range(max(reps, 5))]
    base = (n / statistics.median(copies) / 1e9, n / statistics.median(clones) / 1e9)
    return statistics.median(times), base


async def verify(ch: Channel, tensors: dict[str, torch.Tensor]) -> None:
    await ch.send(make_task("verify"), tensors, to=STAGE_ID)
    got = await ch.recv(timeout=60)
    want = checksum(tensors)
    if not isinstance(got.msg, Result) or got.msg.metrics != want:
        raise RuntimeError(f"transport bench: stage received {got.msg}, expected checksums {want}")


def pct(sorted_us: list[float], q: float) -> float:
    return round(sorted_us[min(len(sorted_us) - 1, int(q * len(sorted_us)))], 1)


class StageProc:
    """The spawned stage and the coordinator's channels to it."""

    def __init__(self, keys: dict[str, dict[str, Any]], gpu: dict[str, Any] | None = None):
        self.directory = tempfile.mkdtemp(prefix="hf-bench-")
        self.chans = {
            key: Channel(
                "router",
                f"ipc://{self.directory}/{key}.sock",
                bind=True,
                name=f"coord-{key}",
                run_id="bench",
                **kw,
            )
            for key, kw in keys.items()
        }
        self.proc = mp.get_context("spawn").Process(
            target=stage_main,
            args=({k: c.endpoint for k, c in self.chans.items()}, gpu),
            name="bench-stage",
            daemon=True,
        )

    async def __aenter__(self) -> StageProc:
        self.proc.start()
        for ch in self.chans.values():
            hello = await ch.recv(timeout=180, timeout_setting="bench stage start-up")
            assert isinstance(hello.msg, Hello)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for ch in self.chans.values():
            try:
                await ch.send(Shutdown(reason="bench done"), to=STAGE_ID, timeout=5)
                break
            except Exception:  # the stage may already be gone; we only want it to exit
                pass
        await asyncio.get_running_loop().run_in_executor(None, self.proc.join, 30)
        if self.proc.is_alive():
            self.proc.kill()
        for ch in self.chans.values():
            ch.close()
        for name in os.listdir(self.directory):
            os.unlink(os.path.join(self.directory, name))
        os.rmdir(self.directory)

"""CUDA graphs of the native engine's decode step, per batch-size and attention-length bucket.

Consumes two step functions that read and write only static buffers (the slot cache and
a logits buffer): `forward(b, n, v)` (the model, rows 0..b-1 attending to the first n
cache positions -> logits[:b], in attention variant v: 0 plain, 1 the paged cache's
shared-prefix split) and `sample(b, truncate)` (sampler + record for rows 0..b-1).
Produces, per batch bucket b, one graph of `forward(b, n, v)` per length bucket n and
variant v and two of `sample(b, .)` (without and with top-k/top-p), all in one memory
pool (they never run concurrently, so they can share it). A batch of B live rows whose
positions are below N replays batch bucket >= B and length bucket >= N, the smallest of
each; rows B..bucket-1 are padding that write only into their own free slots
(SlotCache.record clamps them). Length buckets exist because decode attention costs what it reads: a slot holds
max_prompt_len + max_new_tokens positions, most of them not written yet for most of a
rollout, and with many KV heads (Qwen3: 8 x 128) reading them all dominated the step.

Invariants: capture runs eagerly once per function (warm-up), which WRITES the buffers, so
it only happens while no row is live (at allocation, after wake-up or after parameters
were re-aliased); graphs hold raw pointers to the cache and the weights, so freeing the
cache or replacing a parameter's storage must `clear()` them first.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger("hybridflow.rollout.native")


def default_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to 64, then steps of 32, then 64: padding
    waste stays below ~12% above 64 rows, with a few dozen graphs at most."""
    sizes = [1, 2, 4, 8, *range(16, 65, 16), *range(96, 257, 32), *range(320, 4097, 64)]
    out = [s for s in sizes if s < max_rows]
    return [*out, max_rows]


def default_lengths(max_len: int) -> list[int]:
    """Attention lengths 64, 128, 256, ... below the slot length, then the slot length:
    at most 2x the positions a step needs, and one more graph per doubling."""
    out, n = [], 64
    while n < max_len:
        out.append(n)
        n *= 2
    return [*out, max_len]


def pick(buckets: list[int], n: int, what: str) -> int:
    """The smallest bucket >= n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} {what} exceed the largest bucket {buckets[-1]}")
    return buckets[i]


class DecodeGraphs:
    def __init__(
        self,
        buckets: list[int],
        lengths: list[int],
        forward: Callable[[int, int, int], None],
        sample: Callable[[int, bool], None],
        device: torch.device,
        variants: int = 1,
    ) -> None:
        self.buckets = sorted(set(buckets))
        self.lengths = sorted(set(lengths))
        self.variants = variants
        self._forward, self._sample, self.device = forward, sample, device
        self._fwd: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self._smp: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}

    @property
    def captured(self) -> bool:
        return bool(self._fwd)

    def bucket(self, b: int) -> int:
        return pick(self.buckets, b, "rows")

    def capture(self) -> float:
        """Capture every bucket (largest first, so smaller ones reuse its pool memory).
        Returns the seconds it took."""
        t0 = time.perf_counter()
        self.clear()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: cuBLAS handles, kernel choices, allocator
            for b in self.buckets:
                for n in self.lengths:
                    for v in range(self.variants):
                        self._forward(b, n, v)
                self._sample(b, False)
                self._sample(b, True)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        # No garbage collection while capturing: a collection that frees an earlier
        # engine's graphs (their objects sit in reference cycles) releases CUDA memory
        # inside the capture and invalidates it (seen on the H200 when a test built a
        # fifth engine in one process). Collect first, then hold the collector off.
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            for b in reversed(self.buckets):
                for n in reversed(self.lengths):
                    for v in range(self.variants):
                        step = lambda b=b, n=n, v=v: self._forward(b, n, v)  # noqa: E731
                        self._fwd[(b, n, v)] = self._graph(step, pool)
                for truncate in (False, True):
                    self._smp[(b, truncate)] = self._graph(
                        lambda b=b, t=truncate: self._sample(b, t), pool
                    )
        finally:
            if was_enabled:
                gc.enable()
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        log.info("captured %d decode graphs in %.2f s", len(self._fwd) + len(self._smp), seconds)
        return seconds

    def _graph(self, fn: Callable[[], None], pool: object) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        # thread_local: in a hybrid-engine process the actor / reference run CUDA work in
        # the worker thread while this (the engine's) thread captures, e.g. at wake_up; the
        # default "global" mode lets any other thread's CUDA call invalidate the capture.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            fn()
        return graph

    def replay(self, b: int, n: int, truncate: bool, variant: int = 0) -> int:
        """Run one decode step for b live rows whose positions are below n; returns the
        batch bucket it ran."""
        size = self.bucket(b)
        self._fwd[(size, pick(self.lengths, n, "positions"), variant)].replay()
        self._smp[(size, truncate)].replay()
        return size

    def clear(self) -> None:
        self._fwd.clear()
        self._smp.clear()

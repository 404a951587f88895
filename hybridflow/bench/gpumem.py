"""Device-level GPU memory, sampled while a bench runs.

Stage processes share GPUs: a colocated engine holds rollout, actor and reference in one
process, and a disaggregated topology may put several processes on one device. One
process's torch counters (`max_memory_allocated`) therefore do not say what a device
holds. `nvidia-smi` does: `memory.used` per device counts every process on it, CUDA
contexts, allocator caches and NCCL buffers included. The sampler polls it from a thread
of the bench process (which never touches CUDA itself) and keeps each device's peak.

Invariants: a machine without `nvidia-smi` (the CPU machine) yields None, never an error;
devices are named as the stage processes see them (`cuda:<i>` in CUDA_VISIBLE_DEVICES
order), and devices hidden from the run are left out. A peak sampled every `interval_s`
can miss a spike shorter than that: the figure is a lower bound on the true peak.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from types import TracebackType

QUERY = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
MIB_PER_GB = 1024.0  # nvidia-smi reports MiB; results are GiB like the torch counters


def parse(text: str) -> dict[int, float]:
    """`nvidia-smi` CSV lines `index, used_MiB` -> {physical index: used MiB}."""
    used: dict[int, float] = {}
    for line in text.strip().splitlines():
        index, _, mib = line.partition(",")
        if not mib.strip():
            continue
        try:
            used[int(index)] = float(mib)
        except ValueError:  # "[N/A]" on some boards: no figure rather than a wrong one
            continue
    return used


def visible_devices(env: str | None) -> list[int] | None:
    """CUDA_VISIBLE_DEVICES as physical indices; None when unset or given as UUIDs."""
    if env is None:
        return None
    parts = [p.strip() for p in env.split(",") if p.strip()]
    if not all(p.isdigit() for p in parts):
        return None
    return [int(p) for p in parts]


def name_devices(used: dict[int, float], visible: list[int] | None) -> dict[str, float]:
    """Physical indices -> the `cuda:<i>` names the run's processes use."""
    if visible is None:
        return {f"cuda:{i}": v for i, v in sorted(used.items())}
    return {f"cuda:{n}": used[i] for n, i in enumerate(visible) if i in used}


def _nvidia_smi() -> str:
    return subprocess.run(QUERY, capture_output=True, text=True, timeout=10, check=True).stdout


class DeviceMemorySampler:
    """Context manager: polls device memory every `interval_s` until exit.

    `query` is the seam tests replace (a callable returning nvidia-smi's CSV); by default
    it runs nvidia-smi, and is None (no sampling) where nvidia-smi is not installed.
    """

    def __init__(self, interval_s: float = 0.5, query: Callable[[], str] | None = None) -> None:
        self.interval_s = interval_s
        self._query = (
            query if query is not None else (_nvidia_smi if shutil.which("nvidia-smi") else None)
        )
        self._visible = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
        self._before: dict[str, float] = {}
        self._peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> dict[str, float]:
        assert self._query is not None
        try:
            return name_devices(parse(self._query()), self._visible)
        except (OSError, subprocess.SubprocessError):
            return {}  # one failed poll loses one sample, not the bench

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            for dev, mib in self._sample().items():
                self._peak[dev] = max(self._peak.get(dev, 0.0), mib)

    def __enter__(self) -> DeviceMemorySampler:
        if self._query is not None:
            self._before = self._sample()
            self._peak = dict(self._before)
            self._thread = threading.Thread(target=self._poll, name="bench-gpumem", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def report(self) -> dict[str, dict[str, float]] | None:
        """{device: {"peak_used_gb", "before_gb"}}, or None where nothing was sampled."""
        if not self._peak:
            return None
        return {
            dev: {
                "peak_used_gb": round(mib / MIB_PER_GB, 2),
                "before_gb": round(self._before.get(dev, 0.0) / MIB_PER_GB, 2),
            }
            for dev, mib in sorted(self._peak.items())
        }

"""POSIX shared-memory segments for large CPU tensors (tier 2).

Life of a segment:
  sender:   create `hybridflow-<run>-<pid>-<seq>` (O_EXCL), copy bytes in, unmap, remember name
  receiver: open, mmap, **unlink at once**, hand out zero-copy tensors over the mapping;
            the mapping (and memory) lives until the last tensor viewing it is gone.

Invariant: nothing named `hybridflow-*` outlives a run.
  - normal path: the receiver unlinks right after mapping;
  - the receiver dies before opening: the sender unlinks what it still remembers on close
    (`ShmWriter.close`) or when it learns the peer is dead (`forget_peer`);
  - the sender dies: segments already sent are opened and unlinked by the receiver; the
    launcher sweeps `hybridflow-<run>-*` at teardown (`sweep`) for the rest.
We do not use `multiprocessing.shared_memory`: its resource tracker unlinks segments owned
by another process and warns at exit, which fights receiver-owned release.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from collections.abc import Iterable

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
PREFIX = "hybridflow-"


def _path(name: str) -> str:
    if SHM_DIR is None:  # pragma: no cover - non-Linux
        raise OSError("POSIX shared memory (/dev/shm) is not available on this system")
    return os.path.join(SHM_DIR, name)


class ShmWriter:
    """Creates segments for one sending endpoint and remembers the ones not yet claimed."""

    def __init__(self, run_id: str) -> None:
        safe = "".join(c if c.isalnum() else "_" for c in run_id)[:40]
        self._prefix = f"{PREFIX}{safe}-{os.getpid()}-"
        self._seq = itertools.count()
        self._pending: set[str] = set()
        self._lock = threading.Lock()

    def write(self, chunks: Iterable[tuple[int, memoryview]], total: int) -> str:
        """Create one segment of `total` bytes and copy each `(offset, bytes)` chunk into it."""
        name = f"{self._prefix}{next(self._seq)}"
        if len(self._pending) > 512:
            self._prune()
        fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            with self._lock:
                self._pending.add(name)
            if total:
                os.ftruncate(fd, total)
                with mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
                    for offset, chunk in chunks:
                        m[offset : offset + len(chunk)] = chunk
        except BaseException:
            self._unlink(name)
            raise
        finally:
            os.close(fd)
        return name

    def claimed(self, names: Iterable[str]) -> None:
        """The receiver took these (it unlinked them); stop tracking."""
        with self._lock:
            self._pending.difference_update(names)

    def _prune(self) -> None:
        # Streams without acks (PUSH/PULL) never call `claimed`: forget names the receiver
        # already unlinked so the set stays small.
        with self._lock:
            self._pending = {n for n in self._pending if os.path.exists(_path(n))}

    def pending(self) -> list[str]:
        with self._lock:
            return sorted(self._pending)

    def close(self) -> None:
        """Unlink every segment the receiver never opened (harmless if it did)."""
        for name in self.pending():
            self._unlink(name)

    def _unlink(self, name: str) -> None:
        with self._lock:
            self._pending.discard(name)
        try:
            os.unlink(_path(name))
        except FileNotFoundError:
            pass  # the receiver got it first: the normal case


def open_segment(name: str, size: int) -> mmap.mmap | None:
    """Map segment `name` read-write and unlink it. Returns None for a 0-byte segment."""
    path = _path(name)
    fd = os.open(path, os.O_RDWR)
    try:
        os.unlink(path)  # receiver-owned release: the name is gone, the mapping stays
        actual = os.fstat(fd).st_size
        if actual < size:
            raise ValueError(f"shm segment {name} has {actual} bytes, descriptor needs {size}")
        if size == 0:
            return None
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def sweep(run_id: str | None = None) -> list[str]:
    """Unlink leftover segments of `run_id` (or of every hybridflow run). Returns names."""
    if SHM_DIR is None:  # pragma: no cover
        return []
    prefix = PREFIX
    if run_id is not None:
        prefix += "".join(c if c.isalnum() else "_" for c in run_id)[:40] + "-"
    removed = []
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, entry))
                removed.append(entry)
            except FileNotFoundError:
                pass
    return removed

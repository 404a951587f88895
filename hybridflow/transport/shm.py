"""POSIX shared-memory segments for large CPU tensors (tier 2).

Two kinds of segment, both named `hybridflow-<run>-<pid>-<seq>` in /dev/shm:

  one-shot (ShmWriter, `lease == 0`): the sender creates it, writes the bytes with
  `pwrite` (no page faults, no zeroing of fresh tmpfs pages), sends the name and forgets
  it once the receiver has it. The receiver maps it, **unlinks it at once** and hands out
  zero-copy tensors; the memory goes when the last such tensor goes.

  pooled (ShmPool / ShmReader, `lease > 0`): for a bidirectional channel. The sender
  keeps the segment mapped and reuses it; the receiver maps it once (and unlinks the name
  then), keeps the mapping, and sends `Release(leases=[...])` when its tensors are gone.
  Reuse means neither side pays page faults again: tier 2 then runs near memcpy speed.
  When the sender drops a pooled segment it tells the receiver (`Release(segments=...)`).

Invariant: nothing named `hybridflow-*` outlives a run, whoever dies.
  - a name exists in /dev/shm only between creation and the receiver's first map;
  - the receiver dies first: the sender unlinks what it still remembers on `close` or
    when it learns the peer is dead (`ShmPool.drop_peer`, `ShmWriter.close`);
  - the sender dies first: the survivor sweeps the dead pid's names (`sweep_pid`; the
    pid comes from the peer's Hello/Heartbeat) and the launcher sweeps `hybridflow-<run>-*`
    at teardown (`sweep`).
We do not use `multiprocessing.shared_memory`: its resource tracker unlinks segments owned
by another process and warns at exit, which fights receiver-owned release.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import threading
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import torch

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
PREFIX = "hybridflow-"
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # pre-fault the whole mapping in one syscall


def _path(name: str) -> str:
    if SHM_DIR is None:  # pragma: no cover - non-Linux
        raise OSError("POSIX shared memory (/dev/shm) is not available on this system")
    return os.path.join(SHM_DIR, name)


def run_prefix(run_id: str) -> str:
    """`hybridflow-<run>-`: every segment of one run starts with this."""
    return PREFIX + "".join(c if c.isalnum() else "_" for c in run_id)[:40] + "-"


def of_run(run_id: str, name: str) -> bool:
    """Is `name` a segment of run `run_id`? A receiver opens (and unlinks) nothing else."""
    return name.startswith(run_prefix(run_id)) and "/" not in name


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # the receiver got it first: normal
        os.unlink(_path(name))


def _write_all(fd: int, chunks: Iterable[tuple[int, memoryview]]) -> None:
    for offset, chunk in chunks:
        done = 0
        while done < len(chunk):
            done += os.pwrite(fd, chunk[done:], offset + done)


_SEQ = itertools.count()  # next() is atomic under the GIL


class _Names:
    """Unique segment names of one process and run; remembers the ones not yet handed over."""

    def __init__(self, run_id: str) -> None:
        self.prefix = f"{run_prefix(run_id)}{os.getpid()}-"

    def next(self) -> str:
        # One sequence for the whole process: two writers of one run in one process (the
        # coordinator's and a test's, or two pools) must never make the same name.
        return f"{self.prefix}{next(_SEQ)}"


class ShmWriter:
    """One-shot segments of one sending endpoint; remembers the ones not yet opened.

    A name still in /dev/shm is a segment no receiver has opened yet: `inflight_bytes`
    is what the channel bounds (`shm_inflight_bytes`), so a slow or dead receiver cannot
    make a sender fill /dev/shm (ZeroMQ's HWM counts messages, and a message naming a
    segment is tiny: thousands fit in socket buffers).
    """

    def __init__(self, run_id: str) -> None:
        self._names = _Names(run_id)
        self._pending: dict[str, int] = {}  # name -> bytes
        self._lock = threading.Lock()

    def write(self, chunks: Iterable[tuple[int, memoryview]], total: int) -> str:
        """Create one segment of `total` bytes and write each `(offset, bytes)` chunk into it."""
        name = self._names.next()
        if len(self._pending) > 512:
            self._prune()
        fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            with self._lock:
                self._pending[name] = total
            os.ftruncate(fd, total)
            _write_all(fd, chunks)
        except BaseException:
            self.discard(name)
            raise
        finally:
            os.close(fd)
        return name

    def _prune(self) -> None:
        # Receivers unlink what they open; forget those names.
        with self._lock:
            self._pending = {n: b for n, b in self._pending.items() if os.path.exists(_path(n))}

    def inflight_bytes(self) -> int:
        """Bytes in segments created and not yet opened by any receiver."""
        self._prune()
        with self._lock:
            return sum(self._pending.values())

    def pending(self) -> list[str]:
        self._prune()
        with self._lock:
            return sorted(self._pending)

    def discard(self, name: str) -> None:
        with self._lock:
            self._pending.pop(name, None)
        _unlink(name)

    def close(self) -> None:
        """Unlink every segment the receiver never opened (harmless if it did)."""
        with self._lock:
            names, self._pending = list(self._pending), {}
        for name in names:
            _unlink(name)


# ---------------------------------------------------------------------------------------
# Pooled segments (sender side)


@dataclass(eq=False)
class Segment:
    name: str
    size: int
    map: mmap.mmap
    bytes: torch.Tensor  # [size] uint8 over `map`: copies into it use torch's fast copy
    lease: int = 0  # 0 = free; else the lease in flight
    opened: bool = False  # the receiver has mapped it (and so unlinked the name)


@dataclass
class _PeerPool:
    segments: list[Segment] = field(default_factory=list)
    by_lease: dict[int, Segment] = field(default_factory=dict)

    def total(self) -> int:
        return sum(s.size for s in self.segments)


class ShmPool:
    """Reusable, always-mapped segments per receiving peer (bidirectional channels only).

    `acquire` hands out a free segment that fits (or a new one while the peer's pool is
    under `max_bytes`); `release` returns leases the receiver acked. Retired segments of
    peers still alive are reported by `take_retired` so the channel can tell the receiver.
    """

    MIN_SEGMENT = 1 << 20

    def __init__(self, run_id: str, max_bytes: int) -> None:
        self._names = _Names(run_id)
        self.max_bytes = max_bytes
        self._peers: dict[Hashable, _PeerPool] = {}
        self._lease = itertools.count(1)
        self._retired: dict[Hashable, list[str]] = {}

    def acquire(self, peer: Hashable, nbytes: int) -> tuple[Segment, int] | None:
        """A segment of at least `nbytes` leased to `peer`, or None (pool exhausted)."""
        pool = self._peers.setdefault(peer, _PeerPool())
        free = [s for s in pool.segments if s.lease == 0 and s.size >= nbytes]
        # Best fit, and never more than 4x what is needed (the rest of a big segment would
        # be idle memory held by both processes).
        free = [s for s in free if s.size <= 4 * max(nbytes, self.MIN_SEGMENT)]
        seg = min(free, key=lambda s: s.size) if free else None
        if seg is None:
            size = _round_up(max(nbytes, self.MIN_SEGMENT), self.MIN_SEGMENT)
            if size > self.max_bytes:
                return None
            # Make room by retiring idle segments, largest first, if needed.
            while pool.total() + size > self.max_bytes:
                idle = [s for s in pool.segments if s.lease == 0]
                if not idle:
                    return None
                self._retire(peer, pool, max(idle, key=lambda s: s.size))
            seg = self._create(size)
            pool.segments.append(seg)
        lease = next(self._lease)
        seg.lease = lease
        pool.by_lease[lease] = seg
        return seg, lease

    def mark_sent(self, seg: Segment) -> None:
        # After the first message naming it, the receiver (not us) unlinks the name. If it
        # never maps it, drop_peer/close unlink it.
        seg.opened = True

    def release(self, peer: Hashable, leases: Iterable[int]) -> None:
        pool = self._peers.get(peer)
        if pool is None:
            return
        for lease in leases:
            seg = pool.by_lease.pop(lease, None)
            if seg is not None:
                seg.lease = 0

    def cancel(self, peer: Hashable, lease: int) -> None:
        """The message carrying `lease` was never sent: the segment is free again."""
        self.release(peer, [lease])

    def take_all_retired(self) -> list[tuple[Hashable, list[str]]]:
        """Pooled segments retired since the last call, per peer: tell each receiver."""
        out, self._retired = list(self._retired.items()), {}
        return out

    def has_retired(self) -> bool:
        return bool(self._retired)

    def drop_peer(self, peer: Hashable) -> None:
        """The peer is gone: unmap and unlink all its segments, forget pending notices."""
        pool = self._peers.pop(peer, None)
        self._retired.pop(peer, None)
        if pool is not None:
            for seg in pool.segments:
                self._free(seg)

    def in_flight(self, peer: Hashable = None) -> int:
        pool = self._peers.get(peer)
        return len(pool.by_lease) if pool else 0

    def mapped_bytes(self) -> int:
        return sum(p.total() for p in self._peers.values())

    def close(self) -> None:
        for peer in list(self._peers):
            self.drop_peer(peer)

    # -- internals -------------------------------------------------------------------
    def _create(self, size: int) -> Segment:
        name = self._names.next()
        fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Reserve the pages now: a full /dev/shm is an OSError here, not a SIGBUS on
            # first touch of the mapping.
            os.posix_fallocate(fd, 0, size)
            m = mmap.mmap(fd, size, mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            _unlink(name)
            raise
        finally:
            os.close(fd)
        return Segment(name, size, m, torch.frombuffer(m, dtype=torch.uint8))

    def _retire(self, peer: Hashable, pool: _PeerPool, seg: Segment) -> None:
        pool.segments.remove(seg)
        if seg.opened:
            self._retired.setdefault(peer, []).append(seg.name)
        self._free(seg)

    @staticmethod
    def _free(seg: Segment) -> None:
        _unlink(seg.name)  # no-op if the receiver already did
        seg.bytes = torch.empty(0, dtype=torch.uint8)  # drop the view before unmapping
        with contextlib.suppress(BufferError):  # still viewed somewhere: GC unmaps it later
            seg.map.close()


# ---------------------------------------------------------------------------------------
# Receiver side


def open_segment(name: str, size: int) -> mmap.mmap | None:
    """Map segment `name` read-write and unlink it. Returns None for a 0-byte segment."""
    if not name.startswith(PREFIX) or "/" in name:
        raise ValueError(f"{name!r} is not a hybridflow shared-memory segment")
    path = _path(name)
    fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.unlink(path)  # receiver-owned release: the name is gone, the mapping stays
        actual = os.fstat(fd).st_size
        if actual < size:
            raise ValueError(f"shm segment {name} has {actual} bytes, descriptor needs {size}")
        if size == 0:
            return None
        return mmap.mmap(fd, size, mmap.MAP_SHARED | _POPULATE)
    finally:
        os.close(fd)


class ShmReader:
    """Mappings of pooled segments this receiver was sent, by name (one-shot ones are not
    kept). Dropped when the sender retires them or dies; the memory stays while any
    received tensor still views it."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[Hashable, mmap.mmap]] = {}

    def get(self, peer: Hashable, name: str, size: int) -> mmap.mmap | None:
        entry = self._maps.get(name)
        if entry is not None:
            owner, m = entry
            if owner != peer:
                raise ValueError(f"shm segment {name} belongs to another peer")
            if len(m) < size:
                raise ValueError(f"shm segment {name} has {len(m)} bytes, descriptor needs {size}")
            return m
        opened = open_segment(name, size)
        if opened is not None:
            self._maps[name] = (peer, opened)
        return opened

    def retire(self, peer: Hashable, names: Iterable[str]) -> None:
        for name in names:
            entry = self._maps.get(name)
            if entry is not None and entry[0] == peer:
                del self._maps[name]

    def drop_peer(self, peer: Hashable) -> None:
        for name in [n for n, (p, _) in self._maps.items() if p == peer]:
            del self._maps[name]

    def mapped_bytes(self) -> int:
        return sum(len(m) for _, m in self._maps.values())

    def close(self) -> None:
        self._maps.clear()


# ---------------------------------------------------------------------------------------
# Sweeping after crashes


def sweep(run_id: str | None = None) -> list[str]:
    """Unlink leftover segments of `run_id` (or of every hybridflow run). Returns names."""
    return _sweep(PREFIX if run_id is None else run_prefix(run_id))


def sweep_pid(run_id: str, pid: int) -> list[str]:
    """Unlink leftover segments created by process `pid` in `run_id` (it died)."""
    return _sweep(f"{run_prefix(run_id)}{pid}-")


def _sweep(prefix: str) -> list[str]:
    if SHM_DIR is None:  # pragma: no cover
        return []
    removed = []
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, entry))
                removed.append(entry)
            except FileNotFoundError:
                pass
    return removed


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k

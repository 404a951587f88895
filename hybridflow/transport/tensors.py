"""Tensor payloads beside a message: pick a tier per tensor, describe it, rebuild it.

Tiers (chosen automatically, per tensor):
  1. CPU, < `shm_threshold` bytes -> an extra ZeroMQ frame (sent zero-copy from 64 KiB up:
     do not modify a sent tensor in place until the peer has it);
  2. CPU, >= `shm_threshold` -> POSIX shared memory (shm.py): on a channel with acks
     (ROUTER/DEALER) a pooled, always-mapped segment per peer, released by the receiver's
     `Release(leases=...)`; otherwise (PUSH/PULL, or the pool is full) a one-shot segment;
  3. CUDA, same host -> CUDA IPC handle (cuda_ipc.py), when the channel has that tier;
  4. CUDA, GPU to GPU -> NCCL send/recv (nccl.py), when the channel has that tier.
A CUDA tensor on a channel with neither is staged through CPU (tiers 1-2) so any
channel can carry any tensor.

Received CPU tensors are writable and contiguous; tier 1 tensors own their memory, tier 2
tensors view the segment (zero-copy) and the sender never writes a segment again before
the receiver's tensors over it are gone.

Acks: the codec queues `Release` messages (to the sending peer: leases/ids whose tensors
died; to the receiving peer: pooled segments we retired) in an outbox; the channel sends
them (`take_outbox`) and feeds received ones back (`on_release`). Finalizers may run in
any thread, so the outbox is locked and `on_outbox` is how the channel gets woken.
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from hybridflow.errors import PipelineError, ProtocolError
from hybridflow.transport import shm
from hybridflow.transport.protocol import (
    CudaIpcRef,
    FrameRef,
    NcclRef,
    Release,
    ShmRef,
    TensorDesc,
)

DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
}
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

DEFAULT_SHM_THRESHOLD = 1 << 20  # below 1 MiB a frame copy is cheaper than shm syscalls
DEFAULT_SHM_POOL_BYTES = 1 << 30  # per peer; only the high-water mark of real use is mapped
DEFAULT_SHM_INFLIGHT_BYTES = 1 << 30  # one-shot segments sent and not yet opened


class ShmFull(Exception):
    """`encode` would exceed `shm_inflight_bytes` of unopened one-shot segments: the
    caller waits for the receiver to catch up (backpressure) and tries again."""


_ALIGN = 64

Peer = Hashable  # a ROUTER identity (bytes), or None for the one peer of a DEALER/PUSH/PULL


class CudaTier(Protocol):
    """Seam for tiers 3-4 (CUDA IPC / NCCL); see cuda_ipc.py and nccl.py.

    sender:   `export` (None: let the codec stage the tensor through CPU), then `sent`
              once the message left, or `cancel` if it never will; `release` when the
              receiver acks; `forget_peer` when it died.
    receiver: `import_`; if `zero_copy`, the codec acks (`Release.ids`) when the tensor dies,
              otherwise at once.
    """

    zero_copy: bool

    def export(self, name: str, tensor: torch.Tensor, peer: Peer = None) -> TensorDesc | None: ...
    def sent(self, peer: Peer, descs: Sequence[TensorDesc]) -> None: ...
    def cancel(self, peer: Peer, desc: TensorDesc) -> None: ...
    def release(self, peer: Peer, ids: Sequence[int], *, opened: bool = True) -> None: ...
    def forget_peer(self, peer: Peer) -> None: ...
    def import_(self, desc: TensorDesc, peer: Peer = None) -> torch.Tensor: ...
    def close(self) -> None: ...


@dataclass
class _Acks:
    ids: list[int] = field(default_factory=list)
    leases: list[int] = field(default_factory=list)
    segments: list[str] = field(default_factory=list)
    unopened: list[int] = field(default_factory=list)


@dataclass
class TensorCodec:
    """Per-endpoint encoder/decoder. One instance per channel; not shared across processes.

    `acks`: the channel can carry `Release` back to the sender (ROUTER/DEALER). Only then
    are pooled shm segments used and CUDA IPC tensors held until the receiver is done.
    """

    run_id: str = "local"
    shm_threshold: int = DEFAULT_SHM_THRESHOLD
    cuda: CudaTier | None = None
    acks: bool = False
    shm_pool_bytes: int = DEFAULT_SHM_POOL_BYTES
    shm_inflight_bytes: int = DEFAULT_SHM_INFLIGHT_BYTES
    on_outbox: Callable[[], None] | None = None  # called (any thread) when acks are queued

    def __post_init__(self) -> None:
        self._writer = shm.ShmWriter(self.run_id)
        self._pool = shm.ShmPool(self.run_id, self.shm_pool_bytes)
        self._reader = shm.ShmReader()
        self._outbox: dict[Peer, _Acks] = {}
        # Re-entrant: a finalizer can run (GC) in this very thread while we hold it.
        self._lock = threading.RLock()
        self._closed = False

    @property
    def _cuda_takes_cpu(self) -> bool:
        # Only the NCCL tier built over gloo (to exercise it on CPU machines) says yes.
        return bool(getattr(self.cuda, "handles_cpu", False))

    # -- sending ---------------------------------------------------------------------
    def encode(
        self, tensors: Mapping[str, torch.Tensor], peer: Peer = None
    ) -> tuple[list[TensorDesc], list[Any]]:
        """Descriptors and extra frames for `tensors`, going to `peer`.

        If the message is then not sent, call `abort(descs, peer)` to free what this made.
        Raises ShmFull (having freed everything) when shared memory must wait.
        """
        descs: list[TensorDesc] = []
        frames: list[Any] = []
        big: list[tuple[str, torch.Tensor]] = []
        try:
            for name, t in tensors.items():
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"tensor {name!r} is {type(t).__name__}, expected torch.Tensor")
                if self.cuda is not None and (t.is_cuda or self._cuda_takes_cpu):
                    desc = self.cuda.export(name, t, peer)
                    if desc is not None:
                        descs.append(desc)
                        continue
                t = t.detach()
                if t.device.type != "cpu":
                    t = t.cpu()
                t = t.contiguous()
                nbytes = t.numel() * t.element_size()
                if nbytes >= self.shm_threshold:
                    big.append((name, t))
                    continue
                descs.append(_desc(name, t, FrameRef(index=len(frames))))
                frames.append(_byte_view(t))
            if big:
                descs.extend(self._encode_shm(big, peer))
        except BaseException:
            self.abort(descs, peer)
            raise
        return descs, frames

    def _encode_shm(self, big: list[tuple[str, torch.Tensor]], peer: Peer) -> list[TensorDesc]:
        offsets, total = [], 0
        for _, t in big:
            offsets.append(total)
            total += _round_up(t.numel() * t.element_size(), _ALIGN)
        got = None
        try:
            got = self._pool.acquire(peer, total) if self.acks and total else None
            if got is not None:
                seg, lease = got
                for off, (_, t) in zip(offsets, big, strict=True):
                    n = t.numel() * t.element_size()
                    if n:
                        _copy_bytes(seg.bytes[off : off + n], _flat_bytes(t))
                self._pool.mark_sent(seg)
                name, size = seg.name, seg.size
            else:
                lease = 0
                # Backpressure for shared memory; a lone oversized message still goes.
                inflight = self._writer.inflight_bytes() if self.shm_inflight_bytes else 0
                if inflight and inflight + total > self.shm_inflight_bytes:
                    raise ShmFull(inflight)
                name = self._writer.write(
                    ((off, _byte_view(t)) for off, (_, t) in zip(offsets, big, strict=True)), total
                )
                size = total
        except OSError as exc:
            if got is not None:
                self._pool.cancel(peer, got[1])
            raise PipelineError(
                f"cannot write {total} bytes of tensors to shared memory: {exc}; is /dev/shm "
                "full? enlarge it or raise `transport.shm_threshold` to send by frames"
            ) from exc
        return [
            _desc(n, t, ShmRef(name=name, offset=off, segment_bytes=size, lease=lease))
            for off, (n, t) in zip(offsets, big, strict=True)
        ]

    def abort(self, descs: Sequence[TensorDesc], peer: Peer = None) -> None:
        """A message with these descriptors was never sent: free what `encode` made."""
        for d in descs:
            w = d.where
            if isinstance(w, ShmRef):
                if w.lease:
                    self._pool.cancel(peer, w.lease)
                else:
                    self._writer.discard(w.name)
            elif not isinstance(w, FrameRef) and self.cuda is not None:
                self.cuda.cancel(peer, d)

    def sent(self, descs: Sequence[TensorDesc], peer: Peer = None) -> None:
        """The message with `descs` left the socket (in order): let the CUDA tier act
        (NCCL posts its sends now). Without acks no Release will ever come for CUDA IPC
        tensors, so they are let go at once (torch's share count keeps them valid)."""
        if self.cuda is None:
            return
        cuda_descs = [d for d in descs if not isinstance(d.where, FrameRef | ShmRef)]
        if not cuda_descs:
            return
        self.cuda.sent(peer, cuda_descs)
        if not self.acks:
            ids = [d.where.id for d in cuda_descs if isinstance(d.where, CudaIpcRef)]
            if ids:
                self.cuda.release(peer, ids)

    def pending_shm(self) -> list[str]:
        """One-shot segments created and not yet claimed by a receiver (debugging/tests)."""
        return self._writer.pending()

    def shm_pool_in_flight(self, peer: Peer = None) -> int:
        return self._pool.in_flight(peer)

    # -- receiving -------------------------------------------------------------------
    def decode(
        self, descs: list[TensorDesc], buffers: list[Any], peer: Peer = None
    ) -> dict[str, torch.Tensor]:
        """Rebuild tensors sent by `peer`. Raises ProtocolError for descriptors that do not
        add up; every resource named in `descs` is released even then."""
        out: dict[str, torch.Tensor] = {}
        bases: dict[tuple[str, int], torch.Tensor] = {}  # (segment, lease) -> [bytes] uint8
        try:
            for d in descs:
                dtype = DTYPES.get(d.dtype)
                if dtype is None:
                    raise ProtocolError(f"tensor {d.name!r}: dtype {d.dtype} unsupported here")
                numel = math.prod(d.shape)
                if numel * dtype.itemsize != d.nbytes:
                    raise ProtocolError(
                        f"tensor {d.name!r}: shape {d.shape} x {d.dtype} is "
                        f"{numel * dtype.itemsize} bytes, descriptor says {d.nbytes}"
                    )
                w = d.where
                if isinstance(w, FrameRef):
                    out[d.name] = _copy_frame(buffers[w.index], dtype, d.shape)
                elif isinstance(w, ShmRef):
                    if not shm.of_run(self.run_id, w.name):  # never open another run's file
                        raise ProtocolError(
                            f"tensor {d.name!r}: shm segment {w.name} is not one of run "
                            f"{self.run_id!r} (prefix {shm.run_prefix(self.run_id)})"
                        )
                    key = (w.name, w.lease)
                    if key not in bases:
                        bases[key] = self._map(w, peer)
                    base = bases[key]
                    if d.nbytes == 0:
                        out[d.name] = torch.empty(d.shape, dtype=dtype)
                    else:
                        raw = base[w.offset : w.offset + d.nbytes]
                        out[d.name] = raw.view(dtype).reshape(d.shape)
                else:
                    out[d.name] = self._import_cuda(d, peer)
        except ProtocolError:
            self._release_unmapped(descs, bases, out, peer)
            raise
        except (OSError, ValueError, RuntimeError, TypeError) as exc:
            self._release_unmapped(descs, bases, out, peer)
            raise ProtocolError(f"cannot rebuild tensors: {exc}") from exc
        return out

    def _map(self, w: ShmRef, peer: Peer) -> torch.Tensor:
        """A uint8 tensor over segment `w` whose death releases it (pooled) or unmaps it."""
        try:
            if w.lease:
                m = self._reader.get(peer, w.name, w.segment_bytes)
            else:
                m = shm.open_segment(w.name, w.segment_bytes)
        except FileNotFoundError as exc:
            raise ProtocolError(f"shm segment {w.name} does not exist (sender gone?)") from exc
        if m is None:
            return torch.empty(0, dtype=torch.uint8)
        view = memoryview(m)
        if w.lease and self.acks:
            # Every tensor of this message views `view`; its death is the receiver's ack.
            fin = weakref.finalize(view, self._queue, peer, "leases", w.lease)
            fin.atexit = False
        return torch.frombuffer(view, dtype=torch.uint8)

    def _import_cuda(self, d: TensorDesc, peer: Peer) -> torch.Tensor:
        if self.cuda is None:
            raise ProtocolError(
                f"tensor {d.name!r} uses tier {type(d.where).__name__}, "
                "which this channel was not set up for"
            )
        t = self.cuda.import_(d, peer)
        if isinstance(d.where, CudaIpcRef) and self.acks:
            if getattr(self.cuda, "zero_copy", True):
                fin = weakref.finalize(t, self._queue, peer, "ids", d.where.id)
                fin.atexit = False
            else:
                self._queue(peer, "ids", d.where.id)
        return t

    def _release_unmapped(
        self,
        descs: list[TensorDesc],
        bases: dict[tuple[str, int], torch.Tensor],
        done: dict[str, torch.Tensor],
        peer: Peer,
    ) -> None:
        # Decoding failed half-way: segments we never mapped are unlinked / their leases
        # acked now; mapped ones are acked by their finalizer once `bases` is dropped.
        # CUDA IPC handles we never opened go back as `unopened` (the sender returns the
        # shares; we never touch ref-counter files named by a message we just rejected).
        for d in descs:
            w = d.where
            if isinstance(w, CudaIpcRef) and d.name not in done and self.acks:
                self._queue(peer, "unopened", w.id)
            if isinstance(w, NcclRef) and d.name not in done and self.cuda is not None:
                # The sender posts this transfer regardless: post the matching receive
                # (and drop it), or every later NCCL transfer from it would be mismatched.
                with contextlib.suppress(PipelineError):
                    self.cuda.import_(d, peer)
            if isinstance(w, ShmRef) and (w.name, w.lease) not in bases:
                bases[(w.name, w.lease)] = torch.empty(0)  # once per segment
                if w.lease:
                    if self.acks:
                        self._queue(peer, "leases", w.lease)
                elif shm.of_run(self.run_id, w.name):
                    _discard(w.name)

    # -- acks ------------------------------------------------------------------------
    def _queue(self, peer: Peer, what: str, value: Any) -> None:
        """Queue an ack for `peer` (any thread; also from finalizers)."""
        if self._closed:
            return
        with self._lock:
            acks = self._outbox.setdefault(peer, _Acks())
            getattr(acks, what).append(value)
        cb = self.on_outbox
        if cb is not None:
            cb()

    def take_outbox(self) -> list[tuple[Peer, Release]]:
        """The Release messages to send now, one per peer."""
        for peer, names in self._pool.take_all_retired():
            with self._lock:
                self._outbox.setdefault(peer, _Acks()).segments.extend(names)
        with self._lock:
            box, self._outbox = self._outbox, {}
        return [
            (peer, Release(ids=a.ids, leases=a.leases, segments=a.segments, unopened=a.unopened))
            for peer, a in box.items()
        ]

    def requeue(self, peer: Peer, rel: Release) -> None:
        """Put back a Release the socket could not take now (sent with the next flush)."""
        with self._lock:
            acks = self._outbox.setdefault(peer, _Acks())
            acks.ids.extend(rel.ids)
            acks.leases.extend(rel.leases)
            acks.segments.extend(rel.segments)
            acks.unopened.extend(rel.unopened)

    def has_outbox(self) -> bool:
        return bool(self._outbox) or self._pool.has_retired()

    def on_release(self, peer: Peer, msg: Release) -> None:
        """Apply a Release received from `peer`."""
        if msg.leases:
            self._pool.release(peer, msg.leases)
        if msg.segments:
            self._reader.retire(peer, msg.segments)
        if self.cuda is not None:
            if msg.ids:
                self.cuda.release(peer, msg.ids)
            if msg.unopened:
                self.cuda.release(peer, msg.unopened, opened=False)

    def forget_peer(self, peer: Peer, pid: int | None = None) -> None:
        """`peer` is dead: drop everything held for it or from it; sweep its segments."""
        self._pool.drop_peer(peer)
        self._reader.drop_peer(peer)
        with self._lock:
            self._outbox.pop(peer, None)
        if self.cuda is not None:
            self.cuda.forget_peer(peer)
        if pid:
            shm.sweep_pid(self.run_id, pid)

    def close(self) -> None:
        """Release every resource this endpoint still owns (segments, held CUDA tensors)."""
        self._closed = True
        self._writer.close()
        self._pool.close()
        self._reader.close()
        if self.cuda is not None:
            self.cuda.close()


def _discard(name: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        shm.open_segment(name, 0)


def _desc(name: str, t: torch.Tensor, where: Any) -> TensorDesc:
    try:
        dtype = DTYPE_NAMES[t.dtype]
    except KeyError:
        raise TypeError(f"tensor {name!r}: dtype {t.dtype} cannot be sent") from None
    return TensorDesc(
        name=name,
        dtype=dtype,  # type: ignore[arg-type]
        shape=list(t.shape),
        nbytes=t.numel() * t.element_size(),
        where=where,
    )


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """[nbytes] uint8 view of a contiguous tensor (any dtype, 0-d and bool included)."""
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8)


PARALLEL_COPY_BYTES = 32 << 20


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for [n] uint8 tensors. Below PARALLEL_COPY_BYTES one thread copies:
    torch's parallel copy waits for every pool thread, and on a busy host a descheduled
    one turns a 50 us copy into a 10 ms one. Above it, the threads' bandwidth wins."""
    if dst.numel() < PARALLEL_COPY_BYTES:
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


def _byte_view(t: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a contiguous CPU tensor."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(_flat_bytes(t).numpy())  # type: ignore[arg-type]  # numpy stubs: no Buffer


def _copy_frame(frame: Any, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    # Frames belong to ZeroMQ and are read-only: one copy into memory the tensor owns.
    out = torch.empty(shape, dtype=dtype)
    if out.numel():
        buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        memoryview(_flat_bytes(out).numpy())[:] = buf  # type: ignore[arg-type]
    return out


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k

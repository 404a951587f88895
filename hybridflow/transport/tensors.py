"""Tensor payloads beside a message: pick a tier per tensor, describe it, rebuild it.

Tiers (chosen automatically, per tensor):
  1. CPU, < `shm_threshold` bytes -> an extra ZeroMQ frame, sent zero-copy (the frame
     holds a reference to the tensor's memory until ZeroMQ has sent it);
  2. CPU, >= `shm_threshold` -> one POSIX shared-memory segment per message (shm.py);
  3. CUDA, same host -> CUDA IPC handle (cuda_ipc.py), when the channel allows it;
  4. CUDA, GPU to GPU -> NCCL send/recv (nccl.py), when the channel has a process group.
A CUDA tensor on a channel with neither is staged through CPU (tiers 1-2) so any
channel can carry any tensor.

Received tensors are always writable, contiguous, and own nothing the sender can change.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hybridflow.errors import ProtocolError
from hybridflow.transport import shm
from hybridflow.transport.protocol import FrameRef, ShmRef, TensorDesc

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
_ALIGN = 64


class CudaTier(Protocol):
    """Seam for tiers 3-4 (CUDA IPC / NCCL); see cuda_ipc.py and nccl.py."""

    def export(self, name: str, tensor: torch.Tensor) -> TensorDesc | None: ...
    def import_(self, desc: TensorDesc) -> torch.Tensor: ...


@dataclass
class TensorCodec:
    """Per-endpoint encoder/decoder. One instance per channel; not shared across processes."""

    run_id: str = "local"
    shm_threshold: int = DEFAULT_SHM_THRESHOLD
    cuda: CudaTier | None = None

    def __post_init__(self) -> None:
        self._writer = shm.ShmWriter(self.run_id)

    # -- sending ---------------------------------------------------------------------
    def encode(self, tensors: Mapping[str, torch.Tensor]) -> tuple[list[TensorDesc], list[Any]]:
        descs: list[TensorDesc] = []
        frames: list[Any] = []
        big: list[tuple[str, torch.Tensor]] = []
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor {name!r} is {type(t).__name__}, expected torch.Tensor")
            if t.is_cuda and self.cuda is not None:
                desc = self.cuda.export(name, t)
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
            descs.extend(self._encode_shm(big))
        return descs, frames

    def _encode_shm(self, big: list[tuple[str, torch.Tensor]]) -> list[TensorDesc]:
        offsets, total = [], 0
        for _, t in big:
            offsets.append(total)
            total += _round_up(t.numel() * t.element_size(), _ALIGN)
        name = self._writer.write(
            ((off, _byte_view(t)) for off, (_, t) in zip(offsets, big, strict=True)), total
        )
        return [
            _desc(n, t, ShmRef(name=name, offset=off, segment_bytes=total))
            for off, (n, t) in zip(offsets, big, strict=True)
        ]

    def pending_shm(self) -> list[str]:
        return self._writer.pending()

    def close(self) -> None:
        """Release every resource this endpoint still owns (unclaimed shm segments)."""
        self._writer.close()

    # -- receiving -------------------------------------------------------------------
    def decode(self, descs: list[TensorDesc], buffers: list[Any]) -> dict[str, torch.Tensor]:
        """Rebuild tensors. Raises ProtocolError for descriptors that do not add up."""
        out: dict[str, torch.Tensor] = {}
        segments: dict[str, Any] = {}
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
                    out[d.name] = _from_buffer(_frame_view(buffers[w.index]), dtype, d.shape, copy=True)
                elif isinstance(w, ShmRef):
                    if w.name not in segments:
                        segments[w.name] = _open(w)
                    seg = segments[w.name]
                    view = memoryview(seg)[w.offset : w.offset + d.nbytes] if seg else b""
                    out[d.name] = _from_buffer(view, dtype, d.shape, copy=False)
                else:
                    if self.cuda is None:
                        raise ProtocolError(
                            f"tensor {d.name!r} uses tier {type(w).__name__}, "
                            "which this channel was not set up for"
                        )
                    out[d.name] = self.cuda.import_(d)
        except ProtocolError:
            raise
        except (OSError, ValueError, RuntimeError) as exc:
            raise ProtocolError(f"cannot rebuild tensors: {exc}") from exc
        finally:
            # Every segment named in a message is unlinked even if decoding failed half-way.
            for d in descs:
                if isinstance(d.where, ShmRef) and d.where.name not in segments:
                    _discard(d.where.name)
        return out


def _open(ref: ShmRef):
    try:
        return shm.open_segment(ref.name, ref.segment_bytes)
    except FileNotFoundError as exc:
        raise ProtocolError(f"shm segment {ref.name} does not exist (sender gone?)") from exc


def _discard(name: str) -> None:
    try:
        shm.open_segment(name, 0)
    except (OSError, ValueError):
        pass


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


def _byte_view(t: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a contiguous CPU tensor (any dtype, bf16 and 0-d included)."""
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy())


def _frame_view(frame: Any) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def _from_buffer(buf: Any, dtype: torch.dtype, shape: list[int], *, copy: bool) -> torch.Tensor:
    if len(buf) == 0:
        return torch.empty(shape, dtype=dtype)
    # Frames belong to ZeroMQ and are read-only: one copy into memory the tensor owns.
    # Shm mappings are ours (already unlinked): zero-copy view, kept alive by the tensor.
    raw = torch.frombuffer(bytearray(buf) if copy else buf, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k

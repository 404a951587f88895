"""Tier 3: CUDA tensors between processes of one host, by CUDA IPC handle (zero-copy).

    sender                                         receiver
    export(t): storage._share_cuda_()  --desc-->   import_(desc): open the handle (torch
      hold t under a fresh id                        rebuild, same device), a tensor that
                                                     views the sender's memory
    release(ids): drop t  <--Release(ids)--------  the tensor died (codec finalizer)

Only bytes and ints travel (the CudaIpcRef fields); nothing is pickled.

Why zero-copy (and the receiver acks when its tensor dies) rather than copy-and-ack-at-once:
the hand-off then costs the same for 1 KiB and 1 GiB (no device copy, no second
allocation), which is the point of a same-host tier; consumers in this pipeline use a
received tensor for one task and drop it. `CudaIpcTier(copy=True)` is there for a
consumer that keeps tensors long: it clones on arrival and acks at once, so the
sender's memory is freed early.

Memory safety does not rest on our ack alone: torch counts every share in a shared
ref-counter file, the receiver's storage decrements it when it is freed (after syncing
its stream), and the sender's caching allocator keeps the block in "limbo" until the
counter is zero. Our `Release` tells the sender when to drop its own reference so the
block is freed promptly. A sender must treat a tensor as read-only until it is released
(the receiver sees its memory). On peer death the sender drops what it held for that peer
and returns the dead peer's counter shares itself, so nothing stays in limbo.

Trust: a CUDA IPC peer is a process of the same run on the same host. Shapes and strides
are checked against the storage size the sender declared; that size itself cannot be
checked against the real allocation.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from hybridflow.errors import ProtocolError
from hybridflow.transport.protocol import CudaIpcRef, TensorDesc

MAX_HANDLE_BYTES = 4096

Peer = Hashable


def available() -> bool:
    return torch.cuda.is_available()


@dataclass
class _Held:
    tensor: torch.Tensor  # keeps the storage (and its IPC share) alive until Release
    ref_counter_handle: bytes
    ref_counter_offset: int
    device: int


class CudaIpcTier:
    """The CudaTier for same-host CUDA tensors. One per channel endpoint."""

    zero_copy = True

    def __init__(self, *, copy: bool = False) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA IPC needs a CUDA device; this process sees none")
        self.copy = copy
        self.zero_copy = not copy
        self._ids = itertools.count(1)
        self._held: dict[Peer, dict[int, _Held]] = {}

    # -- sender ------------------------------------------------------------------------
    def export(self, name: str, tensor: torch.Tensor, peer: Peer = None) -> TensorDesc | None:
        if tensor.numel() == 0:
            return None  # nothing to share; an empty frame is cheaper than a handle
        from hybridflow.transport.tensors import DTYPE_NAMES

        dtype = DTYPE_NAMES.get(tensor.dtype)
        if dtype is None:
            raise TypeError(f"tensor {name!r}: dtype {tensor.dtype} cannot be sent")
        storage = tensor.detach().untyped_storage()
        (
            device,
            handle,
            storage_bytes,
            storage_offset_bytes,
            ref_counter_handle,
            ref_counter_offset,
            event_handle,
            event_sync_required,
        ) = storage._share_cuda_()
        ident = next(self._ids)
        self._held.setdefault(peer, {})[ident] = _Held(
            tensor, bytes(ref_counter_handle), int(ref_counter_offset), int(device)
        )
        ref = CudaIpcRef(
            id=ident,
            device=int(device),
            handle=bytes(handle),
            storage_bytes=int(storage_bytes),
            storage_offset_bytes=int(storage_offset_bytes),
            ref_counter_handle=bytes(ref_counter_handle),
            ref_counter_offset=int(ref_counter_offset),
            event_handle=bytes(event_handle) if event_handle is not None else b"",
            event_sync_required=bool(event_sync_required),
            stride=list(tensor.stride()),
            offset=int(tensor.storage_offset()),
        )
        return TensorDesc(
            name=name,
            dtype=dtype,  # type: ignore[arg-type]
            shape=list(tensor.shape),
            nbytes=tensor.numel() * tensor.element_size(),
            where=ref,
        )

    def sent(self, peer: Peer, descs: Sequence[TensorDesc]) -> None:
        """Nothing to do after the message left: the receiver opens the handle itself."""

    def release(self, peer: Peer, ids: Sequence[int], *, opened: bool = True) -> None:
        """The receiver is done with `ids`: drop our references (the memory can go).

        `opened=False`: it never opened them (its decoding failed), so their shares are
        still counted: return them ourselves.
        """
        held = self._held.get(peer)
        if held:
            for ident in ids:
                item = held.pop(ident, None)
                if item is not None and not opened:
                    _return_share(item.ref_counter_handle, item.ref_counter_offset, item.device)

    def cancel(self, peer: Peer, desc: TensorDesc) -> None:
        """The message carrying `desc` never left: return its share ourselves."""
        ref = desc.where
        if isinstance(ref, CudaIpcRef):
            item = self._held.get(peer, {}).pop(ref.id, None)
            if item is not None:
                _return_share(item.ref_counter_handle, item.ref_counter_offset, item.device)

    def forget_peer(self, peer: Peer) -> None:
        """The peer died: its storages will never decrement their shares; do it for them."""
        for item in self._held.pop(peer, {}).values():
            _return_share(item.ref_counter_handle, item.ref_counter_offset, item.device)

    def held(self, peer: Peer = None) -> int:
        return len(self._held.get(peer, {}))

    def close(self) -> None:
        # Our peers are closing too (or dead): nobody will ack what is still held.
        for peer in list(self._held):
            self.forget_peer(peer)

    # -- receiver ----------------------------------------------------------------------
    def import_(self, desc: TensorDesc, peer: Peer = None) -> torch.Tensor:
        ref = desc.where
        if not isinstance(ref, CudaIpcRef):
            raise ProtocolError(f"tensor {desc.name!r}: {type(ref).__name__} is not CUDA IPC")
        dtype = _check(desc, ref)
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        try:
            t: torch.Tensor = rebuild_cuda_tensor(
                torch.Tensor,
                torch.Size(desc.shape),
                tuple(ref.stride),
                ref.offset,
                torch.UntypedStorage,
                dtype,
                ref.device,
                ref.handle,
                ref.storage_bytes,
                ref.storage_offset_bytes,
                False,
                ref.ref_counter_handle,
                ref.ref_counter_offset,
                ref.event_handle,
                ref.event_sync_required,
            )
        except RuntimeError as exc:
            raise ProtocolError(
                f"tensor {desc.name!r}: cannot open CUDA IPC handle: {exc}"
            ) from exc
        if self.copy:
            # Our own memory. Wait for the copy before `t` (and with it the share) is
            # dropped, so the sender may reuse its block as soon as it reads our ack.
            own = t.clone(memory_format=torch.contiguous_format)
            torch.cuda.current_stream(own.device).synchronize()
            return own
        return t


def _check(desc: TensorDesc, ref: CudaIpcRef) -> torch.dtype:
    from hybridflow.transport.tensors import DTYPES

    dtype = DTYPES[desc.dtype]
    if len(ref.stride) != len(desc.shape):
        raise ProtocolError(
            f"tensor {desc.name!r}: {len(ref.stride)} strides for {len(desc.shape)} dims"
        )
    # torch's handle is its own format (a version/kind prefix, then cudaIpcMemHandle_t or an
    # expandable-segment handle); torch parses it, we only bound its size.
    if not 0 < len(ref.handle) <= MAX_HANDLE_BYTES or len(ref.event_handle) > MAX_HANDLE_BYTES:
        raise ProtocolError(f"tensor {desc.name!r}: malformed CUDA IPC handle")
    if ref.device >= torch.cuda.device_count():
        raise ProtocolError(
            f"tensor {desc.name!r}: on cuda:{ref.device}, this process sees "
            f"{torch.cuda.device_count()} device(s) (same CUDA_VISIBLE_DEVICES on both sides?)"
        )
    if math.prod(desc.shape):
        last = ref.offset + sum((n - 1) * s for n, s in zip(desc.shape, ref.stride, strict=True))
        if (last + 1) * dtype.itemsize > ref.storage_bytes:
            raise ProtocolError(
                f"tensor {desc.name!r}: shape {desc.shape} stride {ref.stride} offset "
                f"{ref.offset} reaches past its {ref.storage_bytes}-byte storage"
            )
    return dtype


def _return_share(handle: bytes, offset: int, device: int) -> None:
    # RuntimeError/OSError: the counter file is gone with its process, nothing to return.
    with contextlib.suppress(RuntimeError, OSError):
        torch.UntypedStorage._release_ipc_counter(handle, offset, device=device)

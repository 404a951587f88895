"""Tier 4: CUDA tensors GPU to GPU between processes, by NCCL send/recv.

    NcclGroup(rank, world_size, port, device)   one per process: a TCPStore on 127.0.0.1
        (rank 0 hosts it), a private ProcessGroupNCCL (not torch's default group, so an
        actor's own FSDP/DDP group is untouched), and a warm-up send/recv per rank pair so
        no communicator is created lazily inside a transfer (that would block one side's
        event loop while the other waits for the header).

    sender   export(t)  -> NcclRef(src=my rank, seq) in the header; nothing posted yet
             sent(...)  -> the header left the socket: post isend of t's bytes, in seq order
    receiver import_(d) -> allocate [nbytes] uint8 on my device, post recv from d.src,
                           return it viewed as dtype/shape. `Work.wait()` only makes the
                           current CUDA stream wait: the event loop never blocks on a transfer.

Ordering: NCCL matches p2p operations between a pair strictly in posting order, so both
sides must post in the same order. Channel sends leave in encode order (its FIFO send
path) and ZeroMQ keeps per-connection order, so the receiver sees `seq` increasing per
source; a descriptor that does not is rejected (ProtocolError), never mis-matched. Sends are
posted only after the header left, so an aborted message never leaves an orphan send.
Bytes travel as uint8, so every dtype (bool, bf16, fp8, complex) works the same.

Environment: NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 (set unless the environment
already says otherwise) before any communicator exists.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from hybridflow.errors import PeerDeadError, ProtocolError, TransportTimeout
from hybridflow.transport.protocol import NcclRef, TensorDesc

log = logging.getLogger(__name__)

SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def apply_safe_env() -> None:
    """Keep NVLink multicast off (the shared GPU hosts require it) unless set explicitly."""
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)


apply_safe_env()

Peer = Hashable


def available() -> bool:
    import torch.distributed as dist

    return torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()


class NcclGroup:
    """A private NCCL process group among the transport's GPU peers.

    Every rank calls this with the same `world_size` and `master_port`; rank 0 hosts the
    TCPStore. Blocks until all ranks joined (bounded by `timeout_s`).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        master_port: int,
        device: int | torch.device,
        master_addr: str = "127.0.0.1",
        timeout_s: float = 120.0,
        setting: str = "transport.nccl_timeout_s",
        warmup: bool = True,
    ) -> None:
        import torch.distributed as dist

        apply_safe_env()
        if not (0 <= rank < world_size):
            raise ValueError(f"NCCL rank {rank} outside world of {world_size}")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", device) if isinstance(device, int) else device
        torch.cuda.set_device(self.device)
        self.setting = setting
        timeout = timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(
                master_addr,
                master_port,
                world_size,
                is_master=rank == 0,
                timeout=timeout,
                wait_for_workers=True,
            )
        except (RuntimeError, OSError) as exc:  # DistStoreError is a RuntimeError
            raise TransportTimeout(
                f"NCCL rank {rank}: rendezvous at {master_addr}:{master_port} failed "
                f"({exc}); raise `{setting}` if peers start slowly"
            ) from exc
        self._store = store
        prefixed = dist.PrefixStore("hybridflow-transport", store)
        self._default = False
        self._backend = self._private_backend(prefixed, timeout)
        if warmup:
            self._warmup()

    def _private_backend(self, store: Any, timeout: timedelta) -> Any:
        import torch.distributed as dist

        try:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            opts.is_high_priority_stream = False
            backend = dist.ProcessGroupNCCL(store, self.rank, self.world_size, opts)
            if hasattr(backend, "_set_sequence_number_for_group"):
                backend._set_sequence_number_for_group()
            if hasattr(backend, "eager_connect_single_device"):
                backend.eager_connect_single_device(self.device)
            return backend
        except (AttributeError, TypeError) as exc:
            # An older/newer torch without a constructible backend: fall back to the
            # default group (only if nobody else owns it).
            if dist.is_initialized():
                raise RuntimeError(
                    f"cannot build a private NCCL group on this torch ({exc}) and the "
                    "default process group is taken"
                ) from exc
            log.warning("NCCL: private group unavailable (%s); using the default group", exc)
            dist.init_process_group(
                "nccl", store=store, rank=self.rank, world_size=self.world_size, timeout=timeout
            )
            self._default = True
            return dist.distributed_c10d._get_default_group()

    def isend(self, t: torch.Tensor, dst: int) -> Any:
        if self._default:
            import torch.distributed as dist

            return dist.isend(t, dst)
        return self._backend.send([t], dst, 0)

    def irecv(self, t: torch.Tensor, src: int) -> Any:
        if self._default:
            import torch.distributed as dist

            return dist.irecv(t, src)
        return self._backend.recv([t], src, 0)

    def _warmup(self) -> None:
        # One tiny transfer per pair, all ranks walking pairs in the same global order, so
        # every (lazily created) p2p communicator exists before real traffic.
        one = torch.ones(1, device=self.device)
        for a in range(self.world_size):
            for b in range(a + 1, self.world_size):
                if self.rank == a:
                    self.isend(one, b).wait()
                elif self.rank == b:
                    self.irecv(one, a).wait()
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        import torch.distributed as dist

        backend, self._backend = self._backend, None
        if backend is None:
            return
        if self._default:
            dist.destroy_process_group()
        elif hasattr(backend, "shutdown"):
            try:
                backend.shutdown()
            except RuntimeError as exc:  # a peer already gone: nothing to flush
                log.debug("NCCL shutdown: %s", exc)


@dataclass
class _Pending:
    to_post: dict[int, deque[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    in_flight: deque[tuple[Any, torch.Tensor]] = field(default_factory=deque)


class NcclTier:
    """The CudaTier that moves CUDA tensors by NCCL send/recv inside `group`.

    `rank_of`: the NCCL rank of a channel peer (a mapping, a callable, or one int for the
    single peer of a DEALER/PUSH). Peers without a rank get tensors staged through CPU.
    """

    zero_copy = False  # the receiver owns a fresh tensor; nothing to ack

    def __init__(
        self, group: NcclGroup, rank_of: int | Mapping[Peer, int] | Callable[[Peer], int | None]
    ) -> None:
        self.group = group
        self._rank_of = rank_of
        self._next_seq: dict[int, int] = {}  # per destination rank
        self._last_seen: dict[int, int] = {}  # per source rank
        self._p = _Pending()
        self._reserved: dict[tuple[int, int], torch.Tensor] = {}  # (dst, seq) -> bytes

    def _dst(self, peer: Peer) -> int | None:
        r = self._rank_of
        if isinstance(r, int):
            return r
        if isinstance(r, Mapping):
            return r.get(peer)
        return r(peer)

    # -- sender ------------------------------------------------------------------------
    def export(self, name: str, tensor: torch.Tensor, peer: Peer = None) -> TensorDesc | None:
        dst = self._dst(peer)
        if dst is None or tensor.numel() == 0:
            return None
        from hybridflow.transport.tensors import DTYPE_NAMES

        dtype = DTYPE_NAMES.get(tensor.dtype)
        if dtype is None:
            raise TypeError(f"tensor {name!r}: dtype {tensor.dtype} cannot be sent")
        data = _as_bytes(tensor.detach())
        if data.device != self.group.device:
            data = data.to(self.group.device)
        seq = self._next_seq.get(dst, 0)
        self._next_seq[dst] = seq + 1
        self._reserved[(dst, seq)] = data
        return TensorDesc(
            name=name,
            dtype=dtype,  # type: ignore[arg-type]
            shape=list(tensor.shape),
            nbytes=data.numel(),
            where=NcclRef(src=self.group.rank, seq=seq, device=self.group.device.index or 0),
        )

    def sent(self, peer: Peer, descs: Sequence[TensorDesc]) -> None:
        dst = self._dst(peer)
        if dst is None:
            return
        self._reap()
        for d in sorted(
            (d for d in descs if isinstance(d.where, NcclRef)), key=lambda d: d.where.seq
        ):
            data = self._reserved.pop((dst, d.where.seq), None)  # type: ignore[union-attr]
            if data is not None:
                # Keep `data` alive until NCCL is done with it.
                self._p.in_flight.append((self.group.isend(data, dst), data))

    def cancel(self, peer: Peer, desc: TensorDesc) -> None:
        dst = self._dst(peer)
        if dst is not None and isinstance(desc.where, NcclRef):
            # The seq is skipped, not reused: the receiver only needs it increasing.
            self._reserved.pop((dst, desc.where.seq), None)

    def release(self, peer: Peer, ids: Sequence[int], *, opened: bool = True) -> None:
        """Nothing is held for acks in this tier."""

    def forget_peer(self, peer: Peer) -> None:
        dst = self._dst(peer)
        if dst is not None:
            for key in [k for k in self._reserved if k[0] == dst]:
                del self._reserved[key]

    def _reap(self) -> None:
        q = self._p.in_flight
        while q and q[0][0].is_completed():
            q.popleft()

    def in_flight(self) -> int:
        self._reap()
        return len(self._p.in_flight)

    def close(self) -> None:
        self._reserved.clear()
        self._p.in_flight.clear()

    # -- receiver ----------------------------------------------------------------------
    def import_(self, desc: TensorDesc, peer: Peer = None) -> torch.Tensor:
        ref = desc.where
        if not isinstance(ref, NcclRef):
            raise ProtocolError(f"tensor {desc.name!r}: {type(ref).__name__} is not NCCL")
        from hybridflow.transport.tensors import DTYPES

        dtype = DTYPES[desc.dtype]
        if not (0 <= ref.src < self.group.world_size) or ref.src == self.group.rank:
            raise ProtocolError(
                f"tensor {desc.name!r}: NCCL source rank {ref.src} is not a peer of rank "
                f"{self.group.rank} in a world of {self.group.world_size}"
            )
        last = self._last_seen.get(ref.src, -1)
        if ref.seq <= last:
            raise ProtocolError(
                f"tensor {desc.name!r}: NCCL transfer seq {ref.seq} from rank {ref.src} after "
                f"seq {last}: out of order (send NCCL tensors to a peer on one channel only)"
            )
        if math.prod(desc.shape) * dtype.itemsize != desc.nbytes or desc.nbytes == 0:
            raise ProtocolError(f"tensor {desc.name!r}: {desc.nbytes} bytes for {desc.shape}")
        self._last_seen[ref.src] = ref.seq
        buf = torch.empty(desc.nbytes, dtype=torch.uint8, device=self.group.device)
        try:
            self.group.irecv(buf, ref.src).wait()  # stream-ordered, not a CPU wait
        except RuntimeError as exc:
            raise PeerDeadError(f"NCCL recv from rank {ref.src} failed: {exc}") from exc
        return buf.view(dtype).reshape(desc.shape)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[nbytes] uint8 view of a contiguous copy of `t` (a view when already contiguous)."""
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(torch.uint8)

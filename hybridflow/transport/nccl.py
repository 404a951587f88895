"""Tier 4: CUDA tensors GPU to GPU between processes, by NCCL send/recv.

    NcclGroup(rank, world_size, port, device)   one per process: a TCPStore on 127.0.0.1
        (rank 0 hosts it) and private 2-rank ProcessGroupNCCL communicators, one per
        direction of every pair (not torch's default group, so an actor's own FSDP/DDP
        group is untouched; why per direction: see NcclGroup), created eagerly and warmed
        up so none is created lazily inside a transfer (that would block one side's event
        loop while the other waits for the header).

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
    # Each of our communicators carries one direction of one pair: the serialization
    # this warns about is exactly the order we rely on.
    "TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING": "false",
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
    """Private NCCL communicators among the transport's GPU peers: one per direction of
    every pair.

    Why one per direction: NCCL runs a communicator's operations in posting order on one
    stream, and a send does not finish before its receive is posted. With one
    communicator per pair, A's pending send to B (queued ahead of A's receive from B) and
    B's pending send to A (queued ahead of B's receive from A) wait for each other
    forever as soon as both sides stream large tensors at once. With a communicator per
    direction, each stream holds only sends (at the source) or only receives (at the
    destination), in the same FIFO order on both ends: nothing can wait in a cycle.

    Every rank calls this with the same `world_size` and `master_port`; rank 0 hosts the
    TCPStore. Blocks until all communicators exist (bounded by `timeout_s`).
    `backend="gloo"` builds the same structure over gloo on CPU tensors: how CPU-only
    machines exercise this tier's protocol (NCCL itself needs GPUs).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        master_port: int,
        device: int | torch.device | str,
        master_addr: str = "127.0.0.1",
        timeout_s: float = 120.0,
        setting: str = "transport.nccl_timeout_s",
        backend: str = "nccl",
        warmup: bool = True,
        master_listen_fd: int = -1,
    ) -> None:
        import torch.distributed as dist

        apply_safe_env()
        if not (0 <= rank < world_size):
            raise ValueError(f"NCCL rank {rank} outside world of {world_size}")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"transport group backend {backend!r}: use 'nccl' or 'gloo'")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        if isinstance(device, int):
            device = torch.device("cuda", device)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.setting = setting
        self._timeout = timedelta(seconds=timeout_s)
        try:
            # Rank 0 may adopt a socket its launcher bound and kept listening on
            # `master_port` (`master_listen_fd`): then no other process can take the port.
            self._store = dist.TCPStore(
                master_addr,
                master_port,
                world_size,
                is_master=rank == 0,
                timeout=self._timeout,
                wait_for_workers=True,
                master_listen_fd=master_listen_fd if rank == 0 and master_listen_fd >= 0 else None,
            )
        except (RuntimeError, OSError) as exc:  # DistStoreError is a RuntimeError
            raise TransportTimeout(
                f"{backend} rank {rank}: rendezvous at {master_addr}:{master_port} failed "
                f"({exc}); raise `{setting}` if peers start slowly"
            ) from exc
        self._to: dict[int, Any] = {}  # dst rank -> communicator where we are rank 0
        self._from: dict[int, Any] = {}  # src rank -> communicator where we are rank 1
        # All ranks walk the pairs in one global order: each creation is a blocking
        # collective of its two members, and a shared order cannot deadlock.
        for a in range(world_size):
            for b in range(a + 1, world_size):
                if rank in (a, b):
                    for src, dst in ((a, b), (b, a)):
                        comm = self._pair(src, dst)
                        if rank == src:
                            self._to[dst] = comm
                        else:
                            self._from[src] = comm
        if warmup:
            self._warmup()

    def _pair(self, src: int, dst: int) -> Any:
        """A 2-rank communicator for traffic src -> dst (src is its rank 0)."""
        import torch.distributed as dist

        store = dist.PrefixStore(f"hybridflow-transport/{src}->{dst}", self._store)
        me = 0 if self.rank == src else 1
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private
            opts._timeout = self._timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            return dist.ProcessGroupGloo(store, me, 2, opts)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self._timeout
        opts.is_high_priority_stream = False
        comm = dist.ProcessGroupNCCL(store, me, 2, opts)
        if hasattr(comm, "_set_sequence_number_for_group"):
            comm._set_sequence_number_for_group()
        if hasattr(comm, "eager_connect_single_device"):
            comm.eager_connect_single_device(self.device)
        return comm

    def isend(self, t: torch.Tensor, dst: int) -> Any:
        return self._to[dst].send([t], 1, 0)

    def irecv(self, t: torch.Tensor, src: int) -> Any:
        return self._from[src].recv([t], 0, 0)

    def _warmup(self) -> None:
        # One tiny transfer per communicator, in the same global order everywhere, so
        # every lazily created piece exists before real traffic.
        one = torch.ones(1, device=self.device)
        for a in range(self.world_size):
            for b in range(a + 1, self.world_size):
                for src, dst in ((a, b), (b, a)):
                    if self.rank == src:
                        self.isend(one, dst).wait()
                    elif self.rank == dst:
                        self.irecv(one, src).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Free the communicators without waiting for any peer. A graceful `shutdown()`
        waits for the peer's communicator too: a process that closes its group before
        exiting, while its peer waits for that exit before closing its own, never exits
        (seen on 2x H200: the streamed both-directions test hung in the echo child's
        close after every message had arrived). Nothing is in flight at close (the
        tier's queues are cleared first), so aborting loses nothing."""
        comms = [*self._to.values(), *self._from.values()]
        self._to, self._from = {}, {}
        for comm in comms:
            stop = getattr(comm, "abort", None) or getattr(comm, "shutdown", None)
            if stop is None:
                continue
            try:
                stop()
            except RuntimeError as exc:  # a peer already gone: nothing to flush
                log.debug("transport group close: %s", exc)


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
        # Over gloo (CPU machines) the codec routes CPU tensors here too.
        self.handles_cpu = group.backend == "gloo"
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
        refs = [d.where for d in descs if isinstance(d.where, NcclRef)]
        for ref in sorted(refs, key=lambda r: r.seq):
            data = self._reserved.pop((dst, ref.seq), None)
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

    def wait_sent(self) -> None:
        """Make the caller's stream wait for every posted send (NCCL: no CPU wait; gloo:
        waits), after which the sent tensors may be overwritten (weight sync: before the
        optimizer touches the parameters again)."""
        while self._p.in_flight:
            work, _ = self._p.in_flight.popleft()
            work.wait()

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

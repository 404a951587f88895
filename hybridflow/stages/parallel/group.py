"""The process group of a sharded role's ranks, and the collectives its trainer needs.

The launcher hands every replica of a replicated stage one rendezvous address
(`StageContext.world.init_method`, tcp://host:port) and its rank (= replica); world
size 1 (`fsdp: true` on one device) uses an in-process store, so the same code path runs
without a rendezvous. One default group per process: roles of one stage share it (they
run in one worker thread, so their collectives never interleave).

Invariants: every rank calls the same collectives in the same order (the scheduler sends
every task of a sharded role to all ranks; the worker thread runs them in arrival order);
a collective whose peer died fails after `timeout_s` (the coordinator normally ends the
run long before, naming the dead rank); nothing is pickled between ranks (strings travel
as UTF-8 bytes in uint8 tensors).
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from hybridflow.errors import ConfigError
from hybridflow.stages.base import StageWorld

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Group:
    rank: int
    world_size: int
    device: torch.device

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("fsdp",))

    def _tensor(self, values: list[float], dtype: torch.dtype = torch.float64) -> torch.Tensor:
        # NCCL reduces device tensors only; gloo host tensors.
        dev = self.device if self.backend == "nccl" else torch.device("cpu")
        return torch.tensor(values, dtype=dtype, device=dev)

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over the ranks (float64: exact for counts and token sums)."""
        if self.world_size == 1 or not values:
            return list(values)
        t = self._tensor(values)
        dist.all_reduce(t)
        return [float(v) for v in t.cpu().tolist()]

    def union(self, keys: list[str]) -> list[str]:
        """The sorted union of every rank's `keys` (stat names may differ between ranks:
        a rank whose rows were all masked reports fewer)."""
        if self.world_size == 1:
            return sorted(set(keys))
        blob = "\n".join(sorted(set(keys))).encode()
        size = self._tensor([len(blob)], torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8, device=size.device)
        if blob:
            mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        parts = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine)
        out: set[str] = set()
        for part, n in zip(parts, sizes, strict=True):
            text = bytes(part[: int(n.item())].cpu().tolist()).decode()
            out.update(k for k in text.split("\n") if k)
        return sorted(out)


def join(world: StageWorld, device: torch.device, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Group:
    """Join (or reuse) this process's default group as rank `world.rank` of
    `world.world_size`; raises ConfigError when a replicated stage has no rendezvous."""
    rank, size = world.rank, world.world_size
    group = Group(rank, size, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, size):
            raise ConfigError(
                "stages",
                f"this process is already rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {size}",
            )
        return group
    timeout = datetime.timedelta(seconds=timeout_s)
    if size == 1:
        dist.init_process_group(
            group.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return group
    init_method = world.init_method
    if init_method.startswith("file://"):  # a shared file instead of a port (tests, benches)
        dist.init_process_group(
            group.backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout
        )
        return group
    if not init_method.startswith("tcp://"):
        raise ConfigError(
            "stages", f"rank {rank} of {size} has no tcp:// or file:// rendezvous ({init_method!r})"
        )
    addr = urlsplit(init_method)
    assert addr.hostname is not None and addr.port is not None
    fd = world.init_listen_fd
    # Rank 0 serves the store on the socket the session bound and kept listening (no
    # window in which another process could take the port); the others connect to it.
    store = dist.TCPStore(
        addr.hostname,
        addr.port,
        size,
        is_master=rank == 0,
        timeout=timeout,
        master_listen_fd=fd if rank == 0 and fd >= 0 else None,
    )
    dist.init_process_group(group.backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return group


def exit_rank() -> None:
    """End a rank process started by torch.multiprocessing (bench train, tests): leave
    the group, flush, and exit without interpreter finalization. Finalizing after a gloo
    group now and then aborts the process ("terminate called without an active
    exception", no Python frame left: a native thread torn down at exit; seen about once
    in twenty runs on a loaded 2-core machine). Stage processes already leave this way
    (pipeline/runtime/launcher.py)."""
    leave()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def leave() -> None:
    """Leave the group once every rank is done with it (a barrier first: a rank that
    tears its group down while a peer still talks to it can abort the peer)."""
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()

"""Wrapping a transformers model with FSDP2, and reading its full weights back bucket by
bucket (the colocated reshard, the disaggregated weight stream and the HF export).

Sharding units: every module whose class the model names in `_no_split_modules` (the
decoder layers of every transformers LM), then the root (embeddings, final norm, LM
head, and tied weights, which must share one unit). Parameter names are unchanged by
`fully_shard`, so checkpoints and weight hand-offs use the HF names.

Invariants: gathering is collective, so every rank iterates `full_weights` in the same
order and to the end (a rank that sends nothing still drains it); at most one parameter
beyond the current bucket is unsharded at a time on any rank.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch

from hybridflow.stages.parallel.group import Group
from hybridflow.stages.parallel.options import ShardingOptions

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def shard_model(model: torch.nn.Module, group: Group, opts: ShardingOptions) -> torch.nn.Module:
    """Shard `model` in place over `group` (per layer, then the root); returns it."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mesh = group.mesh()
    mp = MixedPrecisionPolicy(
        param_dtype=_DTYPES[opts.fsdp_param_dtype] if opts.fsdp_param_dtype else None,
        reduce_dtype=_DTYPES[opts.fsdp_reduce_dtype],
    )
    offload = CPUOffloadPolicy() if opts.fsdp_cpu_offload else OffloadPolicy()
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mp,
        "offload_policy": offload,
        "reshard_after_forward": opts.fsdp_reshard_after_forward,
    }
    # FSDP2 warns on every forward whose output is a view (transformers' token-
    # classification head returns one): an in-place op on it would skip a hook. The roles
    # never modify model outputs in place (the critic's ranks equal one process, tested),
    # so the warning is only noise in every stage log.
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning
    )
    names = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def gather(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The full value of a (possibly sharded) tensor: collective for a DTensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    local = t.to_local()
    if local.device != device:  # CPU offload: gather on the group's device
        t = DTensor.from_local(local.to(device), t.device_mesh, t.placements, run_check=False)
    return t.full_tensor()


def full_weights(
    model: torch.nn.Module, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full detached tensor) per parameter, gathered one at a time."""
    for name, p in model.named_parameters():
        yield name, gather(p.detach(), device)


def local_numel(model: torch.nn.Module) -> int:
    """Parameters this rank holds (its shards)."""
    from torch.distributed.tensor import DTensor

    return sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()
    )


def norm_value(norm: torch.Tensor) -> float:
    """A grad norm from clip_grad_norm_ (a replicated DTensor under FSDP) as a float."""
    from torch.distributed.tensor import DTensor

    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)

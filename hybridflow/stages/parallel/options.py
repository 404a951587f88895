"""The sharding options of a trainable (or shardable) role, and when its replicas are ranks.

Invariants: a trainable role with replicas > 1 is always sharded (independent replicas of
a trainer would diverge: `fsdp: false` with several devices is a config error); `fsdp:
true` with one device runs the same FSDP code path at world size 1; a frozen role
(reference) shards only when asked (`fsdp: true`), else its replicas stay independent copies that split
the micro-batches between them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hybridflow.errors import ConfigError

DTYPES = ("float32", "bfloat16")


@dataclass
class ShardingOptions:
    # null (auto): sharded when a trainer has > 1 device; true: also on one device (the
    # same code path at world size 1) and for a frozen role; false: never. A boolean,
    # not on/off words: YAML reads a bare `on` as true.
    fsdp: bool | None = None
    # FSDP mixed precision: the dtype parameters are all-gathered and computed in (None:
    # the model's own `dtype`); master weights and optimizer state stay in `dtype`.
    fsdp_param_dtype: Literal["float32", "bfloat16"] | None = None
    # Gradients are reduce-scattered in this dtype (bfloat16 halves the bytes on the wire).
    fsdp_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    fsdp_cpu_offload: bool = False  # parameters, gradients and optimizer state on the host
    # Free the gathered layer after its forward (True: least memory; False: no second
    # all-gather in backward).
    fsdp_reshard_after_forward: bool = True

    def validate_sharding(self, path: str) -> None:
        if self.fsdp_param_dtype is not None and self.fsdp_param_dtype not in DTYPES:
            raise ConfigError(f"{path}.fsdp_param_dtype", f"must be one of {DTYPES}")
        if self.fsdp_reduce_dtype not in DTYPES:
            raise ConfigError(f"{path}.fsdp_reduce_dtype", f"must be one of {DTYPES}")


def sharded(fsdp: bool | None, *, trainable: bool, replicas: int) -> bool:
    """Whether `replicas` of a role with option `fsdp` are the ranks of one group."""
    if fsdp is not None:
        return bool(fsdp)
    return trainable and replicas > 1


def mode_of(options: Mapping[str, Any]) -> bool | None:
    """The `fsdp` option of a role's raw `options:` block (plan time, after it was checked)."""
    value = options.get("fsdp")
    return None if value is None else bool(value)

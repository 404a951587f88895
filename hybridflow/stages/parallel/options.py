"""The sharding options of a trainable (or shardable) role, and when its replicas are ranks.

Invariants: a trainable role with replicas > 1 is always sharded (independent replicas of
a trainer would diverge: `fsdp: off` with several devices is a config error); `fsdp: on`
with one device runs the same FSDP code path at world size 1; a frozen role (reference)
shards only when asked (`fsdp: on`), else its replicas stay independent copies that split
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
    fsdp: Literal["auto", "on", "off"] = "auto"  # auto: on for a trainer with > 1 device
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
        if self.fsdp not in ("auto", "on", "off"):
            raise ConfigError(f"{path}.fsdp", f"must be auto, on or off, got {self.fsdp!r}")
        if self.fsdp_param_dtype is not None and self.fsdp_param_dtype not in DTYPES:
            raise ConfigError(f"{path}.fsdp_param_dtype", f"must be one of {DTYPES}")
        if self.fsdp_reduce_dtype not in DTYPES:
            raise ConfigError(f"{path}.fsdp_reduce_dtype", f"must be one of {DTYPES}")


def sharded(mode: str, *, trainable: bool, replicas: int) -> bool:
    """Whether `replicas` of a role with sharding option `fsdp: mode` are one group's ranks."""
    if mode == "on":
        return True
    if mode == "off":
        return False
    return trainable and replicas > 1


def mode_of(options: Mapping[str, Any]) -> str:
    """The `fsdp` option of a role's raw `options:` block (plan time: before parsing)."""
    return str(options.get("fsdp", "auto"))

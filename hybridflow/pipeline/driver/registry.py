"""Driver ops: dataflow ops computed in the coordinator process (`role: driver`).

Cheap batch math that needs no model (advantages, whitening, KL penalties) runs here
instead of in a stage. A driver op is either a plain function

    fn(batch: dict[str, Tensor], params: dict[str, scalar]) -> (outputs: dict[str, Tensor],
                                                                metrics: dict[str, float])

or a class whose instances are such callables. A class is constructed once per run (and
once more by `hybridflow validate`) as `Class(topology, index)`: the constructor reads its
`params` from `topology.dataflow[index]`, checks them and the rest of the topology (the
inputs it needs, micro-batch sizes, ...) and raises ConfigError with the dotted key, so
bad settings fail before any process starts. An instance may keep state across steps
(e.g. an adaptive KL coefficient); it lives exactly as long as the run.

Same contract as `Role.handle`: inputs named by the dataflow, outputs must contain every
declared output (extra ones are dropped). The coordinator runs ops in one executor
thread, never on the event loop, so calls never overlap and a slow driver op delays only
the tasks that depend on it.

An op name is a registered name (`advantages`, `identity`, or one added with
`register_driver_op(name, "package.module:attr")`) or a direct "package.module:attr".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.config.imports import load_attr
from hybridflow.errors import ConfigError

if TYPE_CHECKING:
    from hybridflow.config.schema import Topology

Batch = dict[str, torch.Tensor]
DriverFn = Callable[[Batch, dict[str, Any]], tuple[Batch, dict[str, float]]]

DRIVER_OPS: dict[str, str] = {
    "identity": "hybridflow.pipeline.driver.registry:identity",
    "advantages": "hybridflow.pipeline.driver.rl_ops:Advantages",
}


def register_driver_op(name: str, target: str) -> None:
    DRIVER_OPS[name] = target


def resolve_driver_op(
    op: str, path: str, *, topology: Topology | None = None, index: int | None = None
) -> DriverFn:
    """The callable behind `op`; ConfigError at `path` if it does not exist, or (for a
    class) whatever its constructor finds wrong with `topology.dataflow[index]`."""
    target = DRIVER_OPS.get(op, op)
    if ":" not in target:
        raise ConfigError(
            path,
            f"unknown driver op {op!r}; registered: {', '.join(sorted(DRIVER_OPS))}, "
            "or give 'package.module:function'",
        )
    obj = load_attr(target, path)
    if isinstance(obj, type):
        if topology is None or index is None:
            raise ConfigError(
                path, f"driver op {op!r} is a class; it is built from the topology of a run"
            )
        return obj(topology, index)
    if not callable(obj):
        raise ConfigError(path, f"driver op {op!r}: {target} is not callable")
    return obj


def identity(batch: Batch, params: dict[str, Any]) -> tuple[Batch, dict[str, float]]:
    """Pass inputs through under `<name>_out` names (a built-in for tests and examples)."""
    return {f"{k}_out": v for k, v in batch.items()}, {}

"""Driver ops: dataflow ops computed in the coordinator process (`role: driver`).

Cheap batch math that needs no model (advantages, whitening, KL penalties) runs here
instead of in a stage. A driver op is a plain function

    fn(batch: dict[str, Tensor], params: dict[str, scalar]) -> (outputs: dict[str, Tensor],
                                                                metrics: dict[str, float])

with the same contract as `Role.handle` (inputs named by the dataflow, outputs must
contain every declared output). The coordinator runs it in its executor thread, never on
the event loop, so a slow driver op delays only the tasks that depend on it.

An op name is either a registered name (`register_driver_op("grpo_advantages",
"hybridflow.algos.advantages:grpo_driver")`) or a direct "package.module:function".
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from hybridflow.errors import ConfigError

Batch = dict[str, torch.Tensor]
DriverFn = Callable[[Batch, dict[str, Any]], tuple[Batch, dict[str, float]]]

DRIVER_OPS: dict[str, str] = {
    "identity": "hybridflow.pipeline.driver:identity",
}


def register_driver_op(name: str, target: str) -> None:
    DRIVER_OPS[name] = target


def resolve_driver_op(op: str, path: str) -> DriverFn:
    """Import the function behind `op`; ConfigError at `path` if it does not exist."""
    target = DRIVER_OPS.get(op, op)
    if ":" not in target:
        raise ConfigError(
            path,
            f"unknown driver op {op!r}; registered: {', '.join(sorted(DRIVER_OPS))}, "
            "or give 'package.module:function'",
        )
    module, name = target.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(path, f"driver op {op!r}: cannot import {target}: {exc}") from exc
    if not callable(fn):
        raise ConfigError(path, f"driver op {op!r}: {target} is not callable")
    return fn


def identity(batch: Batch, params: dict[str, Any]) -> tuple[Batch, dict[str, float]]:
    """Pass inputs through under `<name>_out` names (a built-in for tests and examples)."""
    return {f"{k}_out": v for k, v in batch.items()}, {}

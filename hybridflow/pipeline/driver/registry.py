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
A module of hybridflow's own that has moved is read under its old name too (`MOVED`):
topologies saved before the move (a checkpoint's meta.json, a run's topology file) name
it there, and resuming them must not fail on the import.

Params are checked at plan time too: a class checks them in its constructor; a function
declares the keys it reads with `@reads_params("expr", "output", check=...)`, so a key
it does not read (a typo) is a ConfigError naming `dataflow[i].params.<key>`. A function
without the declaration (a user's own) takes any params.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

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


# Old module -> where it lives now, for the "package.module:attr" ops of hybridflow's own
# that the step-logic compiler writes into every topology (and so into every saved one).
# Only ever added to: a name a saved topology holds must keep resolving.
MOVED: dict[str, str] = {
    # issue 26: the runtime arithmetic left the compiler for the driver
    "hybridflow.pipeline.compiler.expr": "hybridflow.pipeline.driver.expr",
}


def current_target(target: str) -> str:
    """`"package.module:attr"` with a moved module (`MOVED`) renamed to where it is now."""
    module, sep, attr = target.partition(":")
    return f"{MOVED[module]}{sep}{attr}" if sep and module in MOVED else target


F = TypeVar("F", bound=Callable[..., Any])
ParamsCheck = Callable[[Mapping[str, Any], str], None]  # (params, "dataflow[i].params")
_PARAMS = "__hybridflow_driver_params__"


def register_driver_op(name: str, target: str) -> None:
    DRIVER_OPS[name] = target


def reads_params(*keys: str, check: ParamsCheck | None = None) -> Callable[[F], F]:
    """Declare the `params:` keys a driver function reads (and an optional `check` of
    their values, raising ConfigError); plan time refuses any other key."""

    def mark(fn: F) -> F:
        setattr(fn, _PARAMS, (keys, check))
        return fn

    return mark


def _check_params(fn: Any, params: Mapping[str, Any], path: str) -> None:
    declared = getattr(fn, _PARAMS, None)
    if declared is None:
        return
    keys, check = declared
    for key in params:
        if key not in keys:
            close = difflib.get_close_matches(key, list(keys), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{path}.{key}",
                f"the op reads no param {key!r}; its params: {', '.join(keys) or 'none'}{hint}",
            )
    if check is not None:
        check(params, path)


def resolve_driver_op(
    op: str, path: str, *, topology: Topology | None = None, index: int | None = None
) -> DriverFn:
    """The callable behind `op`; ConfigError at `path` if it does not exist, or (for a
    class) whatever its constructor finds wrong with `topology.dataflow[index]`."""
    target = current_target(DRIVER_OPS.get(op, op))
    if ":" not in target:
        close = difflib.get_close_matches(op, list(DRIVER_OPS), n=1)
        raise ConfigError(
            path,
            f"unknown driver op {op!r}; registered: {', '.join(sorted(DRIVER_OPS))}, "
            "or give 'package.module:function'"
            + (f" (did you mean {close[0]!r}?)" if close else ""),
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
    if topology is not None and index is not None:
        params = topology.dataflow[index].params
        _check_params(obj, params, f"{path.rsplit('.', 1)[0]}.params")
    return obj


@reads_params()
def identity(batch: Batch, params: dict[str, Any]) -> tuple[Batch, dict[str, float]]:
    """Pass inputs through under `<name>_out` names (a built-in for tests and examples)."""
    return {f"{k}_out": v for k, v in batch.items()}, {}

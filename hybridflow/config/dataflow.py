"""The `dataflow:` section: the step as an ordered list of ops `role.op(inputs) -> outputs`,
each `scope: micro_batch` (streamed per micro-batch) or `scope: step` (behind the step
barrier: optimizer step, reshard, weight load). Role `driver` means "computed in the
coordinator process" (advantages and other cheap batch math)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridflow.config.checks import IDENT, finite_positive, join, require
from hybridflow.config.stages import DRIVER_ROLE

# Keys the runtime puts into every Task's params (the mb_gang pair only into a gang's,
# `gang_params`); user params may not shadow them.
RESERVED_PARAMS = ("step", "mb_id", "policy_version", "mb_gang", "mb_gang_first")


def gang_params(gang: tuple[int, int]) -> dict[str, int]:
    """A task's params naming the gang its micro-batch went out in (the same op's
    micro-batches of one step sent to one replica in one scheduling round,
    pipeline/runtime/scheduler.mark_gangs): (first mb_id, size); none when alone."""
    first, size = gang
    return {"mb_gang": size, "mb_gang_first": first} if size > 1 else {}


@dataclass(frozen=True)
class OpConfig:
    """One dataflow op: `role.op(inputs) -> outputs` on each micro-batch or once per step.

    A step-scoped op runs after every op listed before it has finished for the whole step
    (the step barrier); it receives micro-batch values concatenated along dim 0 in mb
    order, and micro-batch ops that consume its outputs get them sliced per micro-batch.
    `phase` names the op in `timing/<phase>` metrics and groups ops for sequential mode.
    `timeout_s` bounds one task of this op: a task not answered within it ends the run with
    an error naming stage, op, step and this key. Unset, the op's default applies (the
    table in pipeline/runtime/watch/deadlines.py and docs/reliability.md: a reward `score` 10 min,
    `generate` 30 min, ...; `liveness.task_timeout_s` for ops the table does not know).
    """

    role: str  # a role some stage hosts, or `driver` (computed in the coordinator)
    op: str  # an op the role's backend declares; for `driver`, a registered op or pkg.mod:attr
    inputs: tuple[str, ...] = ()  # value names the op consumes (data fields or earlier outputs)
    outputs: tuple[str, ...] = ()  # value names it produces; each value has one producer
    # micro_batch: streamed, once per micro-batch; step: once per step, behind the barrier
    scope: Literal["micro_batch", "step"] = "micro_batch"
    phase: str = ""  # default: the op's name
    params: dict[str, Any] = field(default_factory=dict)  # scalars, passed in Task.params
    timeout_s: float | None = None  # None: the op's default (pipeline/runtime/watch/deadlines.py)

    @property
    def phase_name(self) -> str:
        return self.phase or self.op

    @property
    def label(self) -> str:
        return f"{self.role}.{self.op}"

    def validate(self, path: str) -> None:
        require(
            bool(IDENT.match(self.op)) or (self.role == DRIVER_ROLE and ":" in self.op),
            join(path, "op"),
            f"{self.op!r} is not a valid op name (letters, digits, _)",
        )
        if self.timeout_s is not None:
            finite_positive(self.timeout_s, join(path, "timeout_s"))
        for key in ("inputs", "outputs"):
            names = getattr(self, key)
            for i, name in enumerate(names):
                require(
                    bool(IDENT.match(name)),
                    f"{path}.{key}[{i}]",
                    f"{name!r} is not a valid value name (letters, digits, _)",
                )
            require(len(set(names)) == len(names), join(path, key), "has duplicates")
        for key, value in self.params.items():
            sub = join(path, f"params.{key}")
            require(key not in RESERVED_PARAMS, sub, "is set by the runtime; rename it")
            require(
                value is None or isinstance(value, (bool, int, float, str)),
                sub,
                f"must be a scalar (number, string, bool, null), got {type(value).__name__}",
            )
            require(
                not isinstance(value, float) or math.isfinite(value),
                sub,
                f"must be a finite number, got {value!r}",
            )

"""How long one task of an op may run: the per-op default deadlines, in one table.

A task's clock starts when the stage's heartbeat first lists it running (a driver op's
when the coordinator's compute thread starts it); past its bound the run ends with a
StageError naming the stage, op, step, micro-batch and the key to raise
(pipeline/runtime/peers.py). The bound of dataflow op i is, first that applies:

    dataflow[i].timeout_s                  set on the op: always wins
    DEFAULT_TIMEOUT_S[op] (below)          ops whose work is known, capped by
                                           liveness.task_timeout_s when that is lower
    liveness.task_timeout_s (3600 s)       the catch-all: any other op (a custom role's)

    op                       default   one task is
    score                    10 min    a reward function, reward model or reward service
                                       on one micro-batch
    get_logprob, values      15 min    one forward pass over a micro-batch
    generate                 30 min    one micro-batch's responses (long answers, big model)
    update, sft_update       30 min    forward + backward of one micro-batch; its cost is
                                       model size x tokens: set timeout_s for big ones
    optimizer_step           15 min    one optimizer step (sharded: with its all-reduces)
    reshard, load_weights,   20 min    weights moved between training and generation
    sleep, wake_up                     (NCCL for disaggregated rollout), memory freed
    any `driver` op          10 min    computed in the coordinator (advantages, KL, ...)

Why per op: with one bound for all, a deadlocked reward function waited the hour that a
long generation may need, and said nothing. The table is keyed by op name (the names
the stage contract declares, stages/contract.py; every backend of a role kind uses the
same ones), so a reward model's `score` and a reward function's share one default. The
README's deadline table is this one; tests/pipeline/test_waiting_report.py checks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from hybridflow.config.schema import DRIVER_ROLE, LivenessConfig, OpConfig

DEFAULT_TIMEOUT_S: Mapping[str, float] = MappingProxyType(
    {
        "score": 600.0,
        "get_logprob": 900.0,
        "values": 900.0,
        "generate": 1800.0,
        "update": 1800.0,
        "sft_update": 1800.0,
        "optimizer_step": 900.0,
        "reshard": 1200.0,
        "load_weights": 1200.0,
        "sleep": 1200.0,
        "wake_up": 1200.0,
    }
)
DRIVER_TIMEOUT_S = 600.0  # every op of role `driver`


@dataclass(frozen=True)
class Bound:
    """The bound of one wait, as an error or a waiting line names it."""

    seconds: float
    key: str  # the dotted key that sets it
    note: str = ""  # why this value when the key itself is unset

    def text(self) -> str:
        """`dataflow[1].timeout_s` = 600s (unset: the default for `score` ops)"""
        return f"`{self.key}` = {self.seconds:g}s" + (f" ({self.note})" if self.note else "")


def op_bound(op: OpConfig, index: int, live: LivenessConfig) -> Bound:
    """The bound of one task of dataflow op `index` (see the module docstring)."""
    own = f"dataflow[{index}].timeout_s"
    if op.timeout_s is not None:
        return Bound(op.timeout_s, own)
    default = DRIVER_TIMEOUT_S if op.role == DRIVER_ROLE else DEFAULT_TIMEOUT_S.get(op.op)
    if default is None:
        return Bound(live.task_timeout_s, "liveness.task_timeout_s", f"{own} unset")
    kind = "driver" if op.role == DRIVER_ROLE else f"`{op.op}`"
    if live.task_timeout_s < default:
        return Bound(
            live.task_timeout_s,
            "liveness.task_timeout_s",
            f"caps the {default:g}s default for {kind} ops; {own} unset",
        )
    return Bound(default, own, f"unset: the default for {kind} ops")

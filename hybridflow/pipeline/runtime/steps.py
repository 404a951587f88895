"""A step in flight, as the scheduler keeps it: its records and the arithmetic on its rows.

The scheduler (pipeline/runtime/scheduler.py) decides *when* a task runs; this module
holds *what* a step has: its data cut into micro-batches, the values its ops returned
(per micro-batch, or for the whole step), its timings and metric sums, and the sample
rows it keeps. It produces a task's inputs (`StepState.inputs`), joins a finished task's
outputs back in (`TaskState`), and reduces a finished step to its metrics row. No I/O,
no clock: times come in as arguments.

Row arithmetic: a step op sees its micro-batch values concatenated in mb order
(`concat_rows`, right-padding trailing dims that differ), a micro-batch op sees its rows
of a step value, cut back to its own width where the concatenation padded
(`StepState.inputs`), and a sharded op's ranks each get a contiguous share of the rows
(`shard_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from hybridflow.errors import PipelineError
from hybridflow.pipeline.observe.metrics import derive_step_metrics, reduce_step_metric
from hybridflow.pipeline.observe.samples import SAMPLE_FIELDS, sample_fields_extra
from hybridflow.pipeline.plan.planner import DATA, Plan, PlannedOp

Batch = dict[str, torch.Tensor]


class Event(NamedTuple):
    t: float  # clock seconds
    kind: str  # "start" | "dispatch" | "done" | "finish"
    step: int
    mb_id: int  # -1: step-level
    op: int  # op index, -1 for start/finish
    replica: int  # -1: all replicas / driver / n.a.
    policy_version: int
    compute_s: float = 0.0  # "done": seconds the stage spent in Role.handle


@dataclass
class Dispatch:
    task_id: int
    step: int
    mb_id: int
    op: PlannedOp
    replicas: tuple[int, ...]  # () for a driver op
    inputs: Batch
    policy_version: int
    samples: bool = False  # the micro-batch holds sampled rows: ask for the sample fields
    # (first mb_id, size) of the gang it went out in (scheduler.mark_gangs; size 1: alone;
    # step and driver ops keep the default)
    gang: tuple[int, int] = (-1, 1)

    def returns(self) -> list[str]:
        """The outputs the stage is asked to send back (Task.returns)."""
        names = list(self.op.cfg.outputs)
        if self.samples:
            names += [n for n in SAMPLE_FIELDS if n not in names]
        return names

    def inputs_for(self, replica: int) -> Batch:
        """What `replica` receives: its row share for a sharded op, else all inputs."""
        if not self.op.sharded:
            return self.inputs
        return shard_rows(self.inputs, len(self.replicas), self.replicas.index(replica))


@dataclass
class TaskState:
    step: int
    mb_id: int
    op: PlannedOp
    replicas: tuple[int, ...]
    pending: set[int]
    outputs: Batch | None = None
    parts: dict[int, Batch] = field(default_factory=dict)  # sharded: rank -> its outputs
    raw: dict[int, Batch] = field(default_factory=dict)  # replica -> undeclared sample values

    def joined(self) -> Batch:
        """A sharded op's outputs: the ranks' row shares back in rank order (a 0-d value,
        a step scalar, is global: the lowest rank's); else the lowest replica's."""
        if not self.op.sharded:
            assert self.outputs is not None
            return self.outputs
        first = self.parts[self.replicas[0]]
        return {
            n: first[n]
            if first[n].dim() == 0
            else concat_rows([self.parts[r][n] for r in self.replicas])
            for n in self.op.cfg.outputs
        }


@dataclass
class StepState:
    step: int
    n_mb: int
    n_ops: int
    t_start: float
    data: Batch
    mb_values: list[Batch] = field(default_factory=list)
    step_values: Batch = field(default_factory=dict)
    next_mb: list[int] = field(default_factory=list)  # dispatch pointer per op
    done: list[int] = field(default_factory=list)  # finished mbs per op (step ops: 0/1)
    mb_done: list[list[bool]] = field(default_factory=list)
    metric_sum: dict[str, float] = field(default_factory=dict)
    metric_n: dict[str, int] = field(default_factory=dict)
    phase_t0: dict[str, float] = field(default_factory=dict)
    phase_t1: dict[str, float] = field(default_factory=dict)
    compute: dict[str, float] = field(default_factory=dict)
    # tensor bytes the coordinator sent to stages and got back, and seconds inside its
    # sends (encode + copy out): what carrying values through the coordinator costs
    transfer: dict[str, float] = field(
        default_factory=lambda: {"to_stages_mb": 0.0, "from_stages_mb": 0.0, "send_s": 0.0}
    )
    head_versions: list[int] = field(default_factory=list)
    ops_left: int = 0
    picks: list[tuple[int, int]] = field(default_factory=list)  # sample rows: (mb, row)
    mb_extra: list[Batch] = field(default_factory=list)  # per mb: undeclared sample values
    # step op -> padded trailing shape of a ragged input it received -> each micro-batch's
    # own trailing shape (None: two inputs padded to that shape disagree per micro-batch)
    ragged: dict[int, dict[tuple[int, ...], list[tuple[int, ...]] | None]] = field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        self.next_mb = [0] * self.n_ops
        self.done = [0] * self.n_ops
        self.mb_done = [[False] * self.n_mb for _ in range(self.n_ops)]

    # -- inputs ----------------------------------------------------------------------------
    def inputs(self, plan: Plan, op: PlannedOp, m: int) -> Batch:
        """What task (this step, `op`, micro-batch `m`; -1 for a step op) receives."""
        out: Batch = {}
        for name in op.cfg.inputs:
            p = plan.producer[name]
            from_step = p != DATA and plan.ops[p].is_step
            if op.is_step:
                if p == DATA:
                    out[name] = self.data[name]
                elif from_step:
                    out[name] = self.step_values[name]
                else:
                    parts = [v[name] for v in self.mb_values]
                    out[name] = concat_rows(parts)
                    self._note_ragged(op.index, parts, tuple(out[name].shape[1:]))
            elif from_step:
                out[name] = self._slice_step_value(plan, name, m)
            else:
                out[name] = self.mb_values[m][name]
        return out

    def _note_ragged(self, j: int, parts: list[torch.Tensor], padded: tuple[int, ...]) -> None:
        shapes = [tuple(p.shape[1:]) for p in parts]
        if len(set(shapes)) < 2:
            return  # not padded: nothing to undo
        seen = self.ragged.setdefault(j, {})
        if padded in seen and seen[padded] != shapes:
            seen[padded] = None  # ambiguous: which width would a slice go back to?
        else:
            seen.setdefault(padded, shapes)

    def _slice_step_value(self, plan: Plan, name: str, m: int) -> torch.Tensor:
        """Micro-batch m's rows of a step op's value. Where the step op's inputs were
        padded to a common width (responses of different lengths per micro-batch,
        concat_rows), an output of that padded trailing shape is cut back to m's own
        width, so it lines up with m's masks: the inverse of the concatenation."""
        v = self.step_values[name]
        j = plan.producer[name]
        if v.dim() == 0 or v.shape[0] % self.n_mb:
            raise PipelineError(
                f"value {name!r} from step op {plan.ops[j].label} has shape {list(v.shape)}; a "
                f"micro-batch op consumes it, so dim 0 must split evenly into {self.n_mb} "
                "micro-batches"
            )
        rows = v.shape[0] // self.n_mb
        part = v[m * rows : (m + 1) * rows]
        padded = tuple(v.shape[1:])
        seen = self.ragged.get(j, {})
        if padded not in seen:
            return part
        shapes = seen[padded]
        if shapes is None:
            raise PipelineError(
                f"value {name!r} from step op {plan.ops[j].label} has the padded shape "
                f"{list(padded)} of two of its inputs whose micro-batch widths differ; "
                "cannot tell which width micro-batch ops expect"
            )
        for d, width in enumerate(shapes[m], start=1):
            part = part.narrow(d, 0, width)
        return part

    # -- results ---------------------------------------------------------------------------
    def add_metrics(self, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.metric_sum[k] = self.metric_sum.get(k, 0.0) + v
            self.metric_n[k] = self.metric_n.get(k, 0) + 1

    def keep_sample_values(self, t: TaskState, micro_batch: int) -> None:
        """The picked rows of what micro-batch t.mb_id's op returned beyond its declared
        outputs (a scorer's reward_info, a multi-turn rollout's num_turns)."""
        rows = [r for m, r in self.picks if m == t.mb_id]
        if not rows:
            return
        parts = [t.raw[r] for r in sorted(t.raw)]
        if not parts or any(set(p) != set(parts[0]) for p in parts):
            return  # ranks that disagree on what they returned: nothing to show
        whole = (
            parts[0]
            if len(parts) == 1
            else {n: concat_rows([p[n] for p in parts]) for n in parts[0]}
        )
        have = set(self.mb_values[t.mb_id]) | set(self.mb_extra[t.mb_id])
        self.mb_extra[t.mb_id].update(sample_fields_extra(whole, have, rows, micro_batch))

    # -- the finished step -----------------------------------------------------------------
    def metrics(
        self, now: float, last_finish: float | None, policy_version: int, step_batch: int
    ) -> dict[str, float]:
        """The step's metrics row: counters summed, the rest averaged (observe/metrics.py),
        phase timings, the step's time and period, and the policy version its rollout
        started from. `last_finish`: when the previous step finished (None: first)."""
        metrics = {
            k: reduce_step_metric(k, self.metric_sum[k], self.metric_n[k])
            for k in sorted(self.metric_sum)
        }
        for phase, t0 in self.phase_t0.items():
            metrics[f"timing/{phase}"] = self.phase_t1.get(phase, now) - t0
            metrics[f"compute/{phase}"] = self.compute.get(phase, 0.0)
        metrics["timing/step"] = now - self.t_start
        # Under perf/ with the clocks: what a step moves depends on more than its values
        # (the samples a run records are returned by the stages that make them).
        for key, value in self.transfer.items():
            metrics[f"perf/transport_{key}"] = value
        last = last_finish if last_finish is not None else self.t_start
        metrics["timing/period"] = now - last
        versions = self.head_versions or [policy_version]
        metrics["policy_version"] = float(min(versions))
        derive_step_metrics(metrics, step_batch)  # reward/std, perf/*
        return metrics

    def collect(self, names: tuple[str, ...]) -> dict[str, list[torch.Tensor]]:
        """The values `names` of this step: a step value alone, else one per micro-batch."""
        out: dict[str, list[torch.Tensor]] = {}
        for name in names:
            if name in self.step_values:
                out[name] = [self.step_values[name]]
            else:
                out[name] = [v[name] for v in self.mb_values if name in v]
        return out


def shard_rows(batch: Batch, ranks: int, rank: int) -> Batch:
    """Rank `rank`'s contiguous share of every field's rows (dim 0), of `ranks` equal
    shares; 0-d values (step scalars) go to every rank whole."""
    out: Batch = {}
    for name, t in batch.items():
        if t.dim() == 0:
            out[name] = t
            continue
        if t.shape[0] % ranks:
            raise PipelineError(
                f"cannot shard {name!r} of {t.shape[0]} rows over {ranks} ranks evenly; "
                "make run.micro_batch (and run.step_batch) a multiple of the ranks"
            )
        rows = t.shape[0] // ranks
        out[name] = t[rank * rows : (rank + 1) * rows]
    return out


def concat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate micro-batch tensors along dim 0 in mb order. Trailing dims that differ
    (e.g. responses padded per micro-batch) are right-padded with zeros to the largest, so
    masks stay correct (padding is masked out)."""
    if len(parts) == 1:
        return parts[0]
    shapes = {tuple(p.shape[1:]) for p in parts}
    if len(shapes) == 1:
        return torch.cat(parts, dim=0)
    ndims = {p.dim() for p in parts}
    if len(ndims) != 1:
        raise PipelineError(f"cannot concatenate micro-batch tensors of ranks {sorted(ndims)}")
    target = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    padded = []
    for p in parts:
        pad: list[int] = []
        for d in reversed(range(1, p.dim())):
            pad += [0, target[d - 1] - p.shape[d]]
        padded.append(torch.nn.functional.pad(p, pad))
    return torch.cat(padded, dim=0)

"""Synthetic backend: a role with a configurable cost and no model, for benchmarks and tests.

Registered as backend `synthetic` for every role kind. It is NOT a learning component:
it burns a configured amount of time per task and produces the outputs the dataflow
declares for each op, derived deterministically from the inputs, so the runtime's
streaming, ordering, barriers and failure handling can be measured and tested with real
processes and real sockets, without models.

Options (all optional):
  ms_per_sample   cost per input row of a micro-batch op (default 0)
  ms_per_task     fixed cost per task, micro-batch or step op (default 0)
  work            "sleep" (idle wait: stands in for GPU time, lets stages overlap on a
                  small CPU) or "busy" (spins a CPU core)
  ops             per-op overrides, e.g. {reshard: {ms_per_task: 20}}
  output_len      width of `*_ids` / `*_mask` outputs (default 4)
  fail_at         {op, step, mb_id?}: raise RuntimeError there (error-path tests);
                  {op: setup}: in setup, before any task
  die_at          {op, step, mb_id?}: SIGKILL this process there (crash tests)
  expect_ordered  [op, ...]: raise if those ops see the first column of their first
                  input not strictly increasing across calls (order guarantees)
Parsed strictly (`SyntheticOptions`, checked at plan time too): a typo such as
`ms_per_smaple` or `ops.reshard.ms_per_tsk` fails at validate with its dotted key.

Outputs: `tag` = first column of the first input as int64 (the input itself if 1-D;
`[policy_version]` for an op without inputs), B = len(tag);
  `*_ids` / `*_mask` -> int64 [B, output_len], column 0 = tag, column j = (31*tag + j) % 1000
  anything else      -> float32 [B] = tag
so with `sample_idx` as first input every output row names the sample it came from.
Metrics: `<role>/rows`, `<role>/cost_ms`.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from hybridflow.config.loader import from_dict
from hybridflow.errors import ConfigError
from hybridflow.stages.base import Batch, Metrics, OpIO, Params, StageContext
from hybridflow.stages.contract import OpSpec, RoleBase


@dataclass(frozen=True)
class OpCost:
    ms_per_sample: float = 0.0  # cost per input row of a micro-batch op
    ms_per_task: float = 0.0  # fixed cost per task, micro-batch or step op

    def validate(self, path: str) -> None:
        for key in ("ms_per_sample", "ms_per_task"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{path}.{key}", f"must be >= 0, got {getattr(self, key)}")


@dataclass(frozen=True)
class Injection:
    """Where a failure is injected: every key left out matches anything."""

    op: str | None = None
    step: int | None = None
    mb_id: int | None = None


@dataclass(frozen=True)
class SyntheticOptions(OpCost):
    work: Literal["sleep", "busy"] = "sleep"  # sleep: an idle wait (GPU time); busy: spin
    ops: dict[str, OpCost] = field(default_factory=dict)  # per-op cost overrides
    output_len: int = 4  # width of `*_ids` / `*_mask` outputs
    fail_at: Injection | None = None  # {op, step, mb_id}: raise there ({op: setup}: in setup)
    die_at: Injection | None = None  # {op, step, mb_id}: SIGKILL this process there
    # ops that raise if their first input's first column is not increasing across calls
    expect_ordered: list[str] = field(default_factory=list)

    def validate(self, path: str) -> None:
        super().validate(path)
        if self.output_len < 1:
            raise ConfigError(f"{path}.output_len", f"must be >= 1, got {self.output_len}")


class SyntheticRole(RoleBase):
    """Plays any op the dataflow gives it: its declaration is the dataflow's (scope and
    outputs come from the config), so `find_op` answers for every name."""

    options_cls = SyntheticOptions  # checked at plan time too (pipeline/plan/planner.py)

    @classmethod
    def find_op(cls, name: str) -> OpSpec:
        return OpSpec(name=name, method="run", scope=None, outputs=None, params=None)

    def bound_op(self, spec: OpSpec) -> Callable[..., Any]:
        RoleBase.bound_op(self, spec)  # the set-up guard
        return functools.partial(self.run, spec.name)

    def setup(self, ctx: StageContext) -> None:
        opts = from_dict(SyntheticOptions, dict(ctx.options), "synthetic.options")
        self.name = ctx.world.role or "synthetic"
        self.dataflow: dict[str, OpIO] = dict(ctx.world.dataflow)
        self.work = opts.work
        self.default_cost = (opts.ms_per_sample, opts.ms_per_task)
        self.op_costs = {op: (c.ms_per_sample, c.ms_per_task) for op, c in opts.ops.items()}
        self.output_len = opts.output_len
        self.fail_at = opts.fail_at
        self.die_at = opts.die_at
        self.expect_ordered = set(opts.expect_ordered)
        self._last_tag: dict[str, int] = {}
        if opts.fail_at is not None and opts.fail_at.op == "setup":
            raise RuntimeError("synthetic failure injected at setup")

    def run(self, op: str, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        spec = self.dataflow.get(op, OpIO(inputs=tuple(batch)))
        tag = self._tag(spec.inputs, batch, params)
        if op in self.expect_ordered:
            self._check_order(op, tag, params)
        self._inject(op, params)
        per_sample, per_task = self.op_costs.get(op, self.default_cost)
        rows = len(tag) if spec.scope == "micro_batch" else 0
        cost_ms = per_task + per_sample * rows
        self._spend(cost_ms / 1000.0)
        outputs = {name: self._output(name, tag) for name in spec.outputs}
        return outputs, {f"{self.name}/rows": float(len(tag)), f"{self.name}/cost_ms": cost_ms}

    # ------------------------------------------------------------------------------
    @staticmethod
    def _tag(inputs: list[str], batch: Batch, params: Params) -> torch.Tensor:
        if not inputs:
            return torch.tensor([int(params.get("policy_version", 0))], dtype=torch.int64)
        first = batch[inputs[0]]
        col = first if first.dim() <= 1 else first.reshape(first.shape[0], -1)[:, 0]
        return (
            col.reshape(-1).round().to(torch.int64)
            if col.is_floating_point()
            else col.reshape(-1).to(torch.int64)
        )

    def _output(self, name: str, tag: torch.Tensor) -> torch.Tensor:
        if name.endswith(("_ids", "_mask")):
            j = torch.arange(self.output_len, dtype=torch.int64)
            out = (31 * tag[:, None] + j[None, :]) % 1000
            out[:, 0] = tag
            return out
        return tag.to(torch.float32)

    def _check_order(self, op: str, tag: torch.Tensor, params: Params) -> None:
        if tag.numel() == 0:
            return
        first, last = int(tag[0]), int(tag[-1])
        prev = self._last_tag.get(op)
        if (prev is not None and first <= prev) or bool((tag[1:] <= tag[:-1]).any()):
            raise RuntimeError(
                f"synthetic: {op} saw samples out of order at step {params.get('step')} "
                f"mb {params.get('mb_id')}: first {first} after {prev}"
            )
        self._last_tag[op] = last

    def _inject(self, op: str, params: Params) -> None:
        if _matches(self.fail_at, op, params):
            raise RuntimeError(
                f"synthetic failure injected at {op} step {params.get('step')} mb {params.get('mb_id')}"
            )
        if _matches(self.die_at, op, params):
            os.kill(os.getpid(), signal.SIGKILL)

    def _spend(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.work == "sleep":
            time.sleep(seconds)
            return
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def _matches(where: Injection | None, op: str, params: Params) -> bool:
    if where is None:
        return False
    return (
        where.op in (None, op)
        and where.step in (None, params.get("step"))
        and where.mb_id in (None, params.get("mb_id"))
    )

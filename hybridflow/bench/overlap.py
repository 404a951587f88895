"""`hybridflow bench overlap --json [--config FILE]`: how much micro-batch streaming buys.

Runs one topology (default: the bundled `overlap` preset, a balanced synthetic
rollout -> score -> train pipeline) three times over real stage processes:
  1. mode=sequential: each phase finishes the whole step before the next starts;
  2. mode=streamed: micro-batch pipelining (same loop, the phase barrier lifted);
  3. streamed with every synthetic cost set to zero, more steps: the runtime's own cost.
and prints one JSON object:
  sequential_s, streamed_s  wall time of the steps (process startup excluded)
  ideal_s                   lower bound from the measured stage costs of the streamed run:
                            per step, max over stages of (pipeline fill before the stage's
                            first micro-batch + its busy time + drain after its last) plus
                            the step ops (optimizer step, reshard), summed over steps
  speedup                   sequential_s / streamed_s
  efficiency                ideal_s / streamed_s
  micro_batches, steps      per step, and steps per run
  overhead_us_per_event     coordinator process CPU time per task (dispatch + result) with
                            zero-cost stages
  roundtrip_us_per_task     wall time per task in that zero-cost run (throughput view)
The ideal bound assumes steps do not overlap (max_offpolicy_steps = 0).
"""

from __future__ import annotations

import argparse
import copy
from collections import defaultdict
from typing import Any

from hybridflow.config.loader import from_dict, to_dict
from hybridflow.config.schema import Topology, load_topology
from hybridflow.pipeline.plan.planner import Plan, build_plan
from hybridflow.pipeline.runtime.coordinator import RunResult
from hybridflow.pipeline.runtime.runner import run_topology


def run(args: argparse.Namespace) -> dict[str, Any]:
    topo = load_topology(args.config or "overlap", list(getattr(args, "overrides", []) or []))
    if getattr(args, "quick", False):
        topo = _modify(topo, lambda d: d["run"].update(steps=1))
    seq = run_topology(_modify(topo, lambda d: d["run"].update(mode="sequential")))
    stream_topo = _modify(topo, lambda d: d["run"].update(mode="streamed"))
    stream = run_topology(stream_topo)
    zero = run_topology(_zero_cost(stream_topo, steps=3 if getattr(args, "quick", False) else 10))
    ideal = ideal_seconds(build_plan(stream_topo), stream)
    return {
        "config": topo.name,
        "sequential_s": round(seq.wall_s, 4),
        "streamed_s": round(stream.wall_s, 4),
        "ideal_s": round(ideal, 4),
        "speedup": round(seq.wall_s / stream.wall_s, 3),
        "efficiency": round(ideal / stream.wall_s, 3),
        "micro_batches": topo.run.micro_batches,
        "steps": topo.run.steps,
        "overhead_us_per_event": round(zero.coordinator_cpu_s / max(1, zero.tasks) * 1e6, 1),
        "roundtrip_us_per_task": round(zero.wall_s / max(1, zero.tasks) * 1e6, 1),
        "zero_cost_tasks": zero.tasks,
        "startup_s": round(stream.startup_s, 3),
    }


def _modify(topo: Topology, fn: Any) -> Topology:
    data = copy.deepcopy(to_dict(topo))
    fn(data)
    return from_dict(Topology, data)


def _zero_cost(topo: Topology, steps: int) -> Topology:
    def edit(d: dict[str, Any]) -> None:
        d["run"]["steps"] = steps
        d["metrics"]["backends"] = ["memory"]
        for stage in d["stages"].values():
            for role in stage["roles"].values():
                if role["backend"] == "synthetic":
                    opts = role["options"]
                    for key in ("ms_per_sample", "ms_per_task", "ops"):
                        opts.pop(key, None)

    return _modify(topo, edit)


def ideal_seconds(plan: Plan, result: RunResult) -> float:
    """Lower bound of the streamed run from its measured per-task compute times."""
    cost: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)  # (step, op) -> mb -> s
    for ev in result.events:
        if ev.kind == "done":
            prev = cost[(ev.step, ev.op)].get(ev.mb_id, 0.0)
            cost[(ev.step, ev.op)][ev.mb_id] = max(prev, ev.compute_s)  # step ops: slowest replica
    mb_ops = [op for op in plan.ops if not op.is_step]
    replicas = plan.replicas
    total = 0.0
    for step in range(plan.topology.run.steps):
        mean = {op.index: _mean(cost[(step, op.index)]) for op in mb_ops}
        # Longest dependency chain before / after each op, for one micro-batch.
        before: dict[int, float] = {}
        for op in mb_ops:
            before[op.index] = max((before[p] + mean[p] for p in op.deps), default=0.0)
        after: dict[int, float] = {}
        for op in reversed(mb_ops):
            users = [u for u in mb_ops if op.index in u.deps]
            after[op.index] = max((after[u.index] + mean[u.index] for u in users), default=0.0)
        bound = 0.0
        for stage in {op.stage for op in mb_ops}:
            ops = [op for op in mb_ops if op.stage == stage]
            busy = sum(sum(cost[(step, op.index)].values()) for op in ops)
            busy /= replicas.get(stage, 1) if stage else 1
            head = min(before[op.index] for op in ops)
            tail = max(after[op.index] for op in ops)
            bound = max(bound, head + busy + tail)
        steps_ops = sum(_mean(cost[(step, op.index)]) for op in plan.ops if op.is_step)
        total += bound + steps_ops
    return total


def _mean(values: dict[int, float]) -> float:
    return sum(values.values()) / len(values) if values else 0.0

"""One RL step, as the runtime runs it: the project's `train_step`, read off a plan.

There is no loop body to read: the coordinator (runtime/coordinator/) hands tasks out
as their inputs appear, and the scheduler (runtime/scheduler.py) holds the rules. What
one step does is still fixed by the plan, and `outline(plan)` prints it; `hybridflow
validate` shows it for any topology. For the `grpo` preset:

    data batch k (step_batch rows, cut into micro-batches m = 0..M-1)
      |
      |  per micro-batch, streamed: each op starts as soon as its inputs of m exist,
      |  so micro-batch 1 generates while micro-batch 0 is scored (rollout overlaps scoring)
      v
    [0] rollout.generate(m) --+--> [1] reward.score(m) --> [3] driver.advantages(m) --+
                              +--> [2] reference.get_logprob(m) ----------------------+
                                                                                       v
                                                                    [4] actor.update(m)
    ----------------------- step barrier: every op above, for every m -----------------
    [5] actor.optimizer_step()
    [6] actor.reshard()        the hybrid reshard: training weights -> the rollout engine
                               (in process when colocated; streamed to another stage's
                               load_weights when not: pipeline/host/weight_sync.py)
    ---------------------------------------------------------------------------------
    step k+1's heads ([0]: ops that read data fields only) start after [6]; with
    run.max_offpolicy_steps = j they may run up to j steps ahead of it, on older weights.

Who waits for whom (`PlannedOp.deps`, planner.py): a micro-batch op waits for the
producers of its inputs, per micro-batch for micro-batch values and for the whole step
for step values; a step op waits for every op listed before it (the barrier), except the
two ends of a weight link, which run together. At most run.max_inflight tasks are out per
stage replica at once; step ops run alone in their process.
"""

from __future__ import annotations

from hybridflow.pipeline.plan.planner import DATA, Plan, PlannedOp

__all__ = ["outline"]


def outline(plan: Plan) -> list[str]:
    """One step of `plan`, in order: each op, where it runs and what it waits for."""
    run = plan.topology.run
    ops = plan.ops
    width = max(len(op.label) for op in ops)
    where = max(len(_runs_on(op)) for op in ops)

    def line(op: PlannedOp, waits: str, note: str = "") -> str:
        text = (
            f"    [{op.index}] {op.label:<{width}}  on {_runs_on(op):<{where}}  waits for: {waits}"
        )
        return text + (f"   <- {note}" if note else "")

    mode = (
        "streamed: a micro-batch moves on as soon as its inputs exist"
        if run.mode == "streamed"
        else "sequential: each op finishes the whole step before the next starts"
    )
    out = [f"one step: {run.micro_batches} micro-batch(es) of {run.micro_batch} rows, {mode}"]
    micro = [op for op in ops if not op.is_step]
    if micro:
        out.append("  per micro-batch m:")
        out += [line(op, _mb_waits(plan, op)) for op in micro]
    step = [op for op in ops if op.is_step]
    if step:
        out.append("  the step barrier: the ops above, for every micro-batch; then")
        for op in step:
            note = "the hybrid reshard: training weights -> the rollout engine"
            out.append(line(op, _barrier_waits(op), note if op.cfg.op == "reshard" else ""))
    heads = ", ".join(f"[{op.index}]" for op in ops if op.head)
    k = run.max_offpolicy_steps
    ahead = "after this step's last op" if k == 0 else f"up to {k} step(s) ahead of it"
    out.append(f"  the next step's heads ({heads}) start {ahead} (run.max_offpolicy_steps {k})")
    return out


def _runs_on(op: PlannedOp) -> str:
    return op.stage if op.stage is not None else "coordinator"


def _mb_waits(plan: Plan, op: PlannedOp) -> str:
    parts = []
    for name in op.cfg.inputs:
        j = plan.producer[name]
        if j != DATA and plan.ops[j].is_step:
            parts.append(f"[{j}] (the step)")
    per_mb = [j for j in op.deps if not plan.ops[j].is_step]
    if per_mb:
        parts.insert(0, " ".join(f"[{j}]" for j in per_mb) + " of m")
    return ", ".join(parts) or "the step's data"


def _barrier_waits(op: PlannedOp) -> str:
    if op.index == 0:
        return "the step's data"
    apart = sorted(set(range(op.index)) - set(op.deps))
    if not apart:
        return "every op before it"
    runs_with = " ".join(f"[{j}]" for j in apart)
    return f"every op before it but {runs_with} (the other end of its weight link: together)"

"""A run's steps as jobs on one session: training, cut at the validation points.

    run_training(session, plan, start_step=s, sinks=..., validator=v)

        validate(s)            if v.cfg.before_train          (the policy after s updates)
        train s .. p1-1        one job: the coordinator streams and checkpoints as ever
        validate(p1)           p1 = the next multiple of validation.interval
        train p1 .. p2-1
        ...
        validate(end)          if v.cfg.after_train

Without a validator it is one training job, as before. Every job runs on the same
stage processes (pipeline/runtime/session.py), so weights, optimizer state and the
policy version carry on; between jobs the pipeline drains (validation must see one
policy: with max_offpolicy_steps > 0 rollout would otherwise run ahead of it). What a
job-per-chunk would lose is handed on explicitly: the metrics sinks (one set for the
whole run: one metrics.jsonl, one progress bar, one plot), the training data source
(built and tokenized once per run: the caller's, e.g. run_topology's, else one built
here for all the jobs), the driver ops (their state, e.g. an adaptive KL coefficient)
and the checkpointer (its schedule counts run steps). A job's plan is the run's plan
ending at the job's last step, not planned again.

Invariant: the training rows equal those of the same run without validation; each
validation row goes to the same sinks at its step, and into `RunResult.validation`; its
sample rows to the sample sinks (samples.jsonl, split "val").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hybridflow.config.loader import config_hash
from hybridflow.pipeline.checkpoint.checkpointer import Checkpointer
from hybridflow.pipeline.observe.metrics import MetricsSink
from hybridflow.pipeline.observe.samples import sample_sinks, samples_wanted
from hybridflow.pipeline.plan.planner import Plan
from hybridflow.pipeline.runtime.coordinator import RunResult
from hybridflow.pipeline.runtime.jobs.validation import Validator
from hybridflow.pipeline.sources.registry import DataSource, create_source


def run_training(
    session: Any,
    plan: Plan,
    *,
    start_step: int,
    sinks: Sequence[MetricsSink],
    checkpointer: Checkpointer | None = None,
    driver_state: str | None = None,
    collect: Sequence[str] = (),
    validator: Validator | None = None,
    source: DataSource | None = None,
) -> RunResult:
    """Steps `start_step` .. `plan.topology.run.steps - 1`, validated as the module
    docstring says. The caller owns `sinks` (and closes them), and `source` when it
    gives one (built from `plan.topology.data`); else one is built here and closed."""
    topo = plan.topology
    end = topo.run.steps
    points = validator.points(start_step, end) if validator is not None else []
    if validator is not None:
        validator.begin(start_step)
    own = source is None
    if source is None:
        source = create_source(topo.data, topo.seed)
    drivers: dict[int, Any] = {}
    jobs: list[RunResult] = []  # the training jobs
    rows: list[dict[str, float]] = []
    startup_s: float | None = None  # of the first job, which launched the stages
    cursor = start_step
    try:
        for point in sorted({*points, end}):
            if point > cursor:
                chunk = plan if point == end else _until(plan, point)
                jobs.append(
                    session.run_job(
                        chunk,
                        collect=tuple(collect),
                        sinks=sinks,
                        start_step=cursor,
                        checkpointer=checkpointer,
                        driver_state=driver_state,
                        source=source,
                        drivers=drivers,
                    )
                )
                startup_s = jobs[-1].startup_s if startup_s is None else startup_s
                cursor = point
            if validator is not None and point in points:
                metrics, job = validator.run(session, point, samples=samples_wanted(sinks))
                startup_s = job.startup_s if startup_s is None else startup_s
                for sink in sinks:
                    sink.write(point, metrics)
                for s in sample_sinks(sinks):  # between jobs: no event loop runs now
                    s.write_samples(point, validator.sample_rows, validator.tokenizer, "val")
                rows.append({"step": float(point), **metrics})
    finally:
        if own:
            source.close()
    return _merged(jobs, rows, startup_s or 0.0)


def _until(plan: Plan, steps: int) -> Plan:
    """`plan` with its run ending after `steps` steps (a chunk between validations): the
    same processes, ops and dependencies (none of them depends on run.steps), so it is
    not planned again (planning builds, and tokenizes, a data source to check it)."""
    topo = plan.topology
    chunk = dataclasses.replace(topo, run=dataclasses.replace(topo.run, steps=steps))
    return dataclasses.replace(plan, topology=chunk, config_hash=config_hash(chunk))


def _merged(
    jobs: list[RunResult], validation: list[dict[str, float]], startup_s: float
) -> RunResult:
    first = jobs[0]
    collected: dict[int, dict[str, Any]] = {}
    for j in jobs:
        collected.update(j.collected)
    return RunResult(
        run_id=first.run_id,
        metrics=[m for j in jobs for m in j.metrics],
        events=[e for j in jobs for e in j.events],
        collected=collected,
        startup_s=startup_s,
        wall_s=sum(j.wall_s for j in jobs),
        coordinator_cpu_s=sum(j.coordinator_cpu_s for j in jobs),
        tasks=sum(j.tasks for j in jobs),
        checkpoints=[c for j in jobs for c in j.checkpoints],
        validation=validation,
    )

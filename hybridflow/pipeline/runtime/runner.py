"""Run a topology end to end: launch stages, coordinate, tear down; the CLI entry points.

`run_topology(topo)` is the one-shot way a run happens (CLI, benchmarks, tests): one
`Session` (pipeline/runtime/session.py) with one job. It plans the topology, launches
one process per stage replica through a `Launcher`, runs the `Coordinator` and,
whatever happens (success, error, Ctrl-C, SIGTERM), tears down in this order:
    Shutdown to every stage -> close the socket -> launcher.stop (wait, TERM, KILL,
    reap) -> sweep /dev/shm/hybridflow-<run_id>-* -> remove the ipc directory.
Invariant: when `run_topology` returns or raises, no process and no shared-memory
segment of the run is left. (The Python API's Engine keeps a Session across calls.)

Checkpoints and resume (pipeline/checkpoint/): with a `checkpointer` the coordinator
saves after every due step; `resume_dir` + `start_step` continue a run from a
checkpoint (each stage process restores its roles and RNG after setup, the coordinator
its driver ops, and the scheduler starts at `start_step`: the data source and the
samplers are deterministic in the step number, so the continuation equals the
uninterrupted run).

`cli_run` / `cli_validate` back `hybridflow run|validate CONFIG [--set k=v]`; errors
propagate as HybridflowError (the CLI prints one line and exits 2; Ctrl-C exits 130).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from hybridflow.config.schema import Topology, load_topology
from hybridflow.errors import ConfigError, StageError
from hybridflow.pipeline.checkpoint.store import Checkpointer
from hybridflow.pipeline.compiler.plan import build_plan, describe, describe_text
from hybridflow.pipeline.observe.metrics import MetricsSink
from hybridflow.pipeline.runtime.coordinator import RunResult
from hybridflow.pipeline.runtime.launcher import Launcher
from hybridflow.pipeline.runtime.session import STAGE_ENTRY, Session, run_dir_of

__all__ = ["STAGE_ENTRY", "cli_run", "cli_validate", "run_dir_of", "run_topology"]

log = logging.getLogger("hybridflow.runner")


def run_topology(
    topo: Topology,
    *,
    collect: Sequence[str] = (),
    run_id: str | None = None,
    sinks: Sequence[MetricsSink] = (),
    launcher: Launcher | None = None,
    start_step: int = 0,
    resume_dir: str | None = None,
    checkpointer: Checkpointer | None = None,
) -> RunResult:
    """Run `topo` to completion and return its metrics/events. Raises HybridflowError.

    Runs steps `start_step` .. `topo.run.steps - 1`; `resume_dir` is the checkpoint the
    stages restore from (see the module docstring)."""
    check_start(topo, start_step)
    plan = build_plan(topo, check_devices=True)
    honour_log_level(topo.log_level)
    session = Session(plan, launcher=launcher, run_id=run_id, resume_dir=resume_dir)
    try:
        result = session.run_job(
            plan,
            collect=collect,
            sinks=sinks,
            start_step=start_step,
            checkpointer=checkpointer,
            driver_state=resume_dir,
        )
    finally:
        exits = session.close("run finished")
    result.exits = exits
    return result


def check_start(topo: Topology, start_step: int) -> None:
    if not 0 <= start_step < topo.run.steps:
        raise ConfigError(
            "run.steps",
            f"must be greater than the step to start at ({start_step}), got {topo.run.steps}",
        )


def honour_log_level(level: str) -> None:
    """The topology's log_level applies to the coordinator too (stages set their own),
    unless the caller already asked for more detail (e.g. `--log-level DEBUG`)."""
    logger = logging.getLogger("hybridflow")
    wanted = logging.getLevelName(level)
    if wanted < logger.getEffectiveLevel():
        logger.setLevel(wanted)


# ---------------------------------------------------------------------------------------
# CLI


def _load(args: argparse.Namespace) -> Topology:
    if not args.config:
        raise ConfigError("", "give a config: a YAML file or a preset name")
    return load_topology(args.config, list(getattr(args, "overrides", []) or []))


def cli_validate(args: argparse.Namespace) -> int:
    topo = _load(args)
    plan = build_plan(topo)
    note = ""
    try:
        build_plan(topo, check_devices=True)
    except ConfigError as exc:
        note = f"note: cannot run on this machine: {exc}"
    if getattr(args, "json", False):
        out: dict[str, Any] = describe(plan)
        if note:
            out["note"] = note
        print(json.dumps(out, indent=2))
    else:
        print(describe_text(plan))
        if note:
            print(note)
        print("ok")
    return 0


def cli_run(args: argparse.Namespace) -> int:
    topo = _load(args)
    try:
        result = run_topology(topo)
    except StageError as exc:
        # The CLI prints the error as one line; show the remote traceback above it.
        if exc.remote_traceback:
            print("--- remote traceback ---\n" + exc.remote_traceback.rstrip(), file=sys.stderr)
        raise StageError(
            str(exc).split("\n--- remote traceback ---")[0],
            stage=exc.stage,
            replica=exc.replica,
            step=exc.step,
            mb_id=exc.mb_id,
        ) from None
    last = result.metrics[-1] if result.metrics else {}
    print(
        f"run {topo.name} ({result.run_id}): {len(result.metrics)} step(s) in {result.wall_s:.2f}s "
        f"(+{result.startup_s:.2f}s startup), {result.tasks} tasks; "
        f"last step {last.get('timing/step', 0.0):.3f}s"
    )
    if "jsonl" in topo.metrics.backends:
        print(f"metrics: {run_dir_of(topo) / 'metrics.jsonl'}")
    return 0

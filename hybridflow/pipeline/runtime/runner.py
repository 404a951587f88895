"""Run a topology end to end: launch stages, coordinate, tear down; the CLI entry points.

`run_topology(topo)` is the one-shot way a run happens (CLI, benchmarks, tests): one
`Session` (pipeline/runtime/session.py) with one job. It plans the topology and builds
its data source (each once: `plan_run`), launches one process per stage replica through
a `Launcher`, runs the `Coordinator` and, whatever happens (success, error, Ctrl-C,
SIGTERM), tears down in this order:
    Shutdown to every stage -> close the socket -> launcher.stop (wait, TERM, KILL,
    reap) -> sweep /dev/shm/hybridflow-<run_id>-* -> remove the ipc directory.
Invariant: when `run_topology` returns or raises, no process and no shared-memory
segment of the run is left. (The Python API's Engine keeps a Session across calls.)

Checkpoints and resume (pipeline/checkpoint/): with a `checkpointer` (by default the
one the topology's `checkpoint:` section describes) the coordinator saves after every
due step; `resume_dir` + `start_step` continue a run from a checkpoint (each stage
process restores its roles and RNG after setup, the coordinator its driver ops, and the
scheduler starts at `start_step`: the data source and the samplers are deterministic in
the step number, so the continuation equals the uninterrupted run). `resume_point`
turns `--resume DIR|latest` into that pair after checking the checkpoint fits the
topology (same stages, replicas, roles and seed; a step left to run).

Before anything starts, the directories a run writes (run_dir, checkpoint.save_dir,
transport.ipc_dir) are checked: one that cannot be created is a ConfigError naming its
key (exit 2), not an OSError from deep inside the first metrics write. Then run_dir and
the checkpoint directory are locked for the run's life (rundir_lock.py): a second run on
either is a ConfigError naming the holder's pid; a dead holder's lock is taken over.

`cli_run` / `cli_validate` back `hybridflow run|validate CONFIG [--set k=v]`
(`run --launcher ray [--address ADDR]`: stage processes on a Ray cluster, ray_launcher.py); errors
propagate as HybridflowError (the CLI prints one line and exits 2; Ctrl-C exits 130).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridflow.config.imports import cwd_off_path
from hybridflow.config.loader import to_dict
from hybridflow.config.schema import Topology, load_topology
from hybridflow.errors import ConfigError, StageError
from hybridflow.pipeline.checkpoint import resume as ckpt
from hybridflow.pipeline.checkpoint.checkpointer import Checkpointer
from hybridflow.pipeline.observe.metrics import MetricsSink, make_sinks
from hybridflow.pipeline.plan.planner import (
    Plan,
    build_plan,
    check_devices_exist,
    describe,
    describe_text,
    trainer_stages,
)
from hybridflow.pipeline.runtime.coordinator import RunResult
from hybridflow.pipeline.runtime.jobs.training import run_training
from hybridflow.pipeline.runtime.jobs.validation import Validator
from hybridflow.pipeline.runtime.launcher import Launcher
from hybridflow.pipeline.runtime.session import Session, run_dir_of
from hybridflow.pipeline.runtime.stage_specs import places_hosts
from hybridflow.pipeline.runtime.watch.rundir_lock import lock_dirs
from hybridflow.pipeline.sources.registry import DataSource, create_source

__all__ = [
    "checkpoint_dir",
    "cli_run",
    "cli_validate",
    "resume_point",
    "run_dir_of",
    "run_topology",
]

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
    stages restore from (see the module docstring). Without a `checkpointer`, the
    topology's `checkpoint:` section (if any) makes one."""
    check_start(topo, start_step)
    plan, source = plan_run(topo, check_devices=not places_hosts(launcher))
    try:
        check_dirs(topo)
        if checkpointer is None and topo.checkpoint is not None:
            checkpointer = topology_checkpointer(topo)
        honour_log_level(topo.log_level)
        # One run per directory, for the run's life (pipeline/runtime/watch/rundir_lock.py).
        with lock_dirs(owned_dirs(topo, checkpointer), f"run {topo.name!r}"):
            return _run_locked(
                topo,
                plan,
                source,
                collect,
                run_id,
                sinks,
                launcher,
                start_step,
                resume_dir,
                checkpointer,
            )
    finally:
        source.close()


def plan_run(topo: Topology, *, check_devices: bool) -> tuple[Plan, DataSource]:
    """The run's plan and its training data source, each built once: the plan does not
    build a source of its own to check `data` (the one built here checks it, just
    after the plan's other checks), so every prompt is tokenized once per run. The
    caller closes the source. `check_devices`: False for a multi-host launcher, whose
    processes run on its nodes (their GPUs are not ours to count)."""
    plan = build_plan(topo, check_devices=check_devices, check_data=False)
    return plan, create_source(topo.data, topo.seed)


def _run_locked(
    topo: Topology,
    plan: Plan,
    source: DataSource,
    collect: Sequence[str],
    run_id: str | None,
    sinks: Sequence[MetricsSink],
    launcher: Launcher | None,
    start_step: int,
    resume_dir: str | None,
    checkpointer: Checkpointer | None,
) -> RunResult:
    # Validation's source is read (and a missing file named) before any process starts.
    validator = Validator(topo, run_dir_of(topo)) if topo.validation is not None else None
    session = Session(plan, launcher=launcher, run_id=run_id, resume_dir=resume_dir)
    all_sinks: list[MetricsSink] = []
    try:
        all_sinks = make_sinks(topo.metrics.backends, run_dir_of(topo), topo, start_step)
        all_sinks += list(sinks)
        result = run_training(
            session,
            plan,
            start_step=start_step,
            sinks=all_sinks,
            checkpointer=checkpointer,
            driver_state=resume_dir,
            collect=collect,
            validator=validator,
            source=source,
        )
    finally:
        for sink in all_sinks:
            with contextlib.suppress(Exception):
                sink.close()
        if validator is not None:
            validator.close()
        exits = session.close("run finished")
    result.exits = exits
    return result


def owned_dirs(topo: Topology, checkpointer: Checkpointer | None = None) -> list[tuple[str, Path]]:
    """The directories a run writes and must not share: (config key, path)."""
    dirs = [("run_dir", run_dir_of(topo))]
    if checkpointer is not None:
        dirs.append(("checkpoint.save_dir", Path(checkpointer.cfg.save_dir)))
    return dirs


def checkpoint_dir(topo: Topology) -> Path:
    """Where the topology's checkpoints go: checkpoint.save_dir, else <run_dir>/checkpoints."""
    cfg = topo.checkpoint
    return (
        Path(cfg.save_dir) if cfg is not None and cfg.save_dir else run_dir_of(topo) / "checkpoints"
    )


def topology_checkpointer(topo: Topology) -> Checkpointer | None:
    """The Checkpointer the `checkpoint:` section describes (None without one)."""
    if topo.checkpoint is None:
        return None
    cfg = dataclasses.replace(topo.checkpoint, save_dir=str(checkpoint_dir(topo)))
    return Checkpointer(cfg, last_step=topo.run.steps - 1)


def check_dirs(topo: Topology) -> None:
    """The directories the run writes can be created (nothing is created here: a run
    without file sinks leaves no run_dir behind); else a ConfigError naming the key."""
    dirs = [("run_dir", run_dir_of(topo))]
    if topo.checkpoint is not None:
        dirs.append(("checkpoint.save_dir", checkpoint_dir(topo)))
    if topo.transport.protocol == "ipc" and topo.transport.ipc_dir:
        dirs.append(("transport.ipc_dir", Path(topo.transport.ipc_dir)))
    for key, path in dirs:
        why = _uncreatable(path.absolute())
        if why:
            raise ConfigError(
                key, f"cannot create directory {str(path)!r}: {why}; choose a writable directory"
            )


def _uncreatable(path: Path) -> str:
    """Why `mkdir -p path` would fail ("" if it would not), judged from its nearest
    existing ancestor."""
    if path.is_dir():
        return "" if os.access(path, os.W_OK | os.X_OK) else "not writable"
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing == path:
        return "exists and is not a directory"
    if not existing.is_dir():
        return f"{str(existing)!r} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{str(existing)!r} is not writable"
    return ""


def resume_point(topo: Topology, spec: str) -> tuple[str, int]:
    """`--resume DIR|latest` -> (checkpoint directory, the step to start at).

    'latest' looks under the topology's checkpoint directory (`checkpoint_dir`). The
    checkpoint must have been written by this topology's stages (same stages, replicas,
    roles: each process restores its own part; a stage that trains may change its number
    of ranks, its weights being DCP shards) and seed (the data order and samplers derive
    from it), and must leave a step to run."""
    path, meta = checkpoint_of(topo, spec, "--resume")
    step = int(meta["step"])
    if step >= topo.run.steps:
        raise ConfigError(
            "run.steps",
            f"is {topo.run.steps}, and checkpoint {str(path)!r} already holds {step} "
            "step(s): nothing left to run; raise run.steps to train further",
        )
    return str(path), step


def checkpoint_of(topo: Topology, spec: str, key: str) -> tuple[Path, dict[str, Any]]:
    """`DIR|latest` -> (checkpoint directory, its meta), checked to fit `topo`'s stages
    and seed (see `resume_point`); errors name `key` (the flag that gave `spec`)."""
    try:
        path = ckpt.resolve(spec, checkpoint_dir(topo))
        meta = ckpt.read_meta(path)
    except ConfigError as exc:
        raise ConfigError(key, str(exc).removeprefix(f"{exc.path}: ")) from None
    config = meta.get("config") or {}
    theirs = ckpt.stage_layout(config.get("stages") or {})
    ours = ckpt.stage_layout(to_dict(topo.stages))
    for stage in trainer_stages(topo):  # ranks of a sharded model: any count resumes
        if stage in theirs and stage in ours:
            theirs[stage] = (ours[stage][0], theirs[stage][1])
    if theirs != ours:
        raise ConfigError(
            key,
            f"{str(path)!r} was written by stages {theirs}; this topology has {ours} "
            "(a checkpoint resumes the same roles on the same processes)",
        )
    if meta.get("seed") != topo.seed:
        raise ConfigError(
            "seed",
            f"is {topo.seed}, but checkpoint {str(path)!r} was written with seed "
            f"{meta.get('seed')}; resume with the seed the run started with",
        )
    return path, meta


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
    # A YAML names modules (`package.module:attr`) that validating imports: from installed
    # packages and PYTHONPATH only, never the working directory unless asked.
    with cwd_off_path(allow=bool(getattr(args, "allow_cwd_imports", False))):
        return _validate(args)


def _validate(args: argparse.Namespace) -> int:
    topo = _load(args)
    plan = build_plan(topo)  # planned once: the devices are checked apart, below
    validation = describe_validation(topo)
    note = ""
    try:
        check_devices_exist(topo)
    except ConfigError as exc:
        note = f"note: cannot run on this machine: {exc}"
    if getattr(args, "json", False):
        out: dict[str, Any] = describe(plan)
        if validation:
            out["validation"] = validation
        if note:
            out["note"] = note
        print(json.dumps(out, indent=2))
    else:
        print(describe_text(plan))
        if validation:
            ops = ", ".join(validation["ops"])
            print(
                f"validation: {validation['prompts']} prompts x {validation['n']} from "
                f"{validation['source']}, {ops}"
            )
        if note:
            print(note)
        print("ok")
    return 0


def describe_validation(topo: Topology) -> dict[str, Any]:
    """The validation job `topo` declares, checked as a run would (its source read and
    tokenized, its dataflow planned); {} without a validation: section."""
    if topo.validation is None:
        return {}
    validator = Validator(topo, run_dir_of(topo))
    try:
        return {
            "source": topo.validation.source,
            "prompts": validator.prompts,
            "n": topo.validation.n,
            "ops": [op.label for op in validator.topology.dataflow],
            "interval": topo.validation.interval,
        }
    finally:
        validator.close()


def cli_run(args: argparse.Namespace) -> int:
    topo = _load(args)
    start, resume_dir = 0, None
    resume = getattr(args, "resume", None)
    if resume is not None:
        resume_dir, start = resume_point(topo, resume)
        print(f"resuming {topo.name} from {resume_dir} at step {start}")
        if topo.checkpoint is None:
            print("note: no checkpoint: section, so this run writes no further checkpoints")
    launcher: Launcher | None = None
    if getattr(args, "launcher", "local") == "ray":  # imports ray only now
        from hybridflow.pipeline.runtime.ray_launcher import RayLauncher

        launcher = RayLauncher(getattr(args, "address", None))
        if topo.transport.protocol == "ipc":  # the default: switch to TCP between hosts
            raw = to_dict(topo)
            raw["transport"] = {**raw["transport"], **launcher.transport_settings()}
            topo = load_topology(raw)
            print(f"ray launcher: transport tcp on {topo.transport.host} (no shared memory)")
    elif getattr(args, "address", None):
        raise ConfigError("--address", "is for --launcher ray only")
    try:
        result = run_topology(topo, start_step=start, resume_dir=resume_dir, launcher=launcher)
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
    if result.checkpoints:
        print(f"checkpoint: {result.checkpoints[-1]}")
    return 0

"""`hybridflow eval CONFIG [--checkpoint DIR|latest]`: one validation, no training.

Starts the topology's stage processes (restoring the checkpoint when one is given: every
role, the rollout engine's weights included, loads the policy it holds), runs the
`validation:` section's job once (pipeline/runtime/jobs/validation.py) and prints one JSON
object: the `val/` metrics, the step the policy was trained for (0 for the initial
models) and the checkpoint. Sample generations, when `validation.generations` asks for
them, go to `<run_dir>/eval_generations.jsonl` (the training run's
val_generations.jsonl is left alone). Exit 2 with one line on a config error, as `run`.
It writes nothing else into run_dir, so it does not take the run's lock (evaluating the
latest checkpoint of a run still training is the point); it holds `<run_dir>/eval.lock`
instead, so that a second eval on the same run_dir is refused (rundir_lock.py). It writes
no status.json: that file belongs to the run_dir's lock holder.

The processes started are the training topology's, all of them (a session runs jobs on
the processes of the topology it was launched with): eval costs the startup of a run,
then one validation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

from hybridflow.config.imports import cwd_off_path
from hybridflow.config.schema import Topology
from hybridflow.errors import ConfigError
from hybridflow.pipeline.plan.planner import build_plan
from hybridflow.pipeline.runtime.jobs.validation import Validator
from hybridflow.pipeline.runtime.runner import _load, check_dirs, checkpoint_of, honour_log_level
from hybridflow.pipeline.runtime.session import Session, run_dir_of
from hybridflow.pipeline.runtime.watch.rundir_lock import DirLock

EVAL_GENERATIONS = "eval_generations.jsonl"
EVAL_LOCK = "eval.lock"


def evaluate(topo: Topology, checkpoint: str | None = None) -> dict[str, Any]:
    """The validation metrics of `topo`'s policy (initial, or `checkpoint`'s)."""
    if topo.validation is None:
        raise ConfigError(
            "validation",
            "eval needs a validation: section (or --set validation.source=FILE|task:NAME)",
        )
    resume_dir, step = None, 0
    if checkpoint is not None:
        path, meta = checkpoint_of(topo, checkpoint, "--checkpoint")
        resume_dir, step = str(path), int(meta["step"])
    plan = build_plan(topo, check_devices=True)
    check_dirs(topo)
    honour_log_level(topo.log_level)
    # Its own lock, not the run's: eval reads checkpoints and writes only its own file, so
    # it may run beside the training it evaluates; two evals on one run_dir may not.
    with DirLock(run_dir_of(topo), "run_dir", f"eval {topo.name!r}", name=EVAL_LOCK):
        validator = Validator(topo, run_dir_of(topo), generations_file=EVAL_GENERATIONS)
        session = Session(plan, resume_dir=resume_dir)
        try:
            metrics, result = validator.run(session, step)
        finally:
            with contextlib.suppress(Exception):
                validator.close()
            session.close("eval finished")
    return {"step": step, "checkpoint": resume_dir, "startup_s": result.startup_s, **metrics}


def cli_eval(args: argparse.Namespace) -> int:
    with cwd_off_path(allow=False):
        topo = _load(args)
    out = evaluate(topo, getattr(args, "checkpoint", None))
    print(json.dumps(out, indent=2))
    return 0

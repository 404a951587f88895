"""The Engine: runs a job a DataflowBuilder compiled, on stage processes that stay up.

    engine = df.build(...)                       (hybridflow.pipeline.api.builder)
    engine.train(dataset, steps=N)               N RL steps of the compiled training step
    engine.sft(dataset, steps=N)                 actor.sft_update steps, then the exported
                                                 policy replaces the initial model
    engine.run(prompts)                          ONE step of the logic on `prompts`: a
                                                 training step if it updates a role, else
                                                 generate + score; -> the declared outputs
    engine.save_checkpoint(path, interval, keep) where and how often train() checkpoints
    engine.resume("latest" | path)               continue a checkpointed job
    engine.close()  /  with df.build(...) as engine: ...

Life time: the first call starts one process per stage replica of the whole topology
(every stage, whatever that call needs) and loads every model; every later call is a
job on the same processes (pipeline/runtime/session.py), so a second call costs no
startup and weights stay where they are: a `run` after a `train` samples the trained
policy, and a second `train` continues the first (optimizer, policy version, step).
Each job sends a subset of the training topology's ops (`sft`: its own).
The processes stop at `close()`, at the end of a `with` block, or when the Engine is
garbage collected (a weakref finalizer; the children also die with this process).
They are restarted, at the next call, from `state` when
  - a call raised (a stage failed or died, Ctrl-C): the processes may hold half a step;
  - `resume()` chose a checkpoint: the processes restore it at setup;
  - `sft()` exported a policy: every role (reference included) reloads from it, with a
    fresh optimizer, and RL starts from it at step 0.
`close()` does not end the Engine: a later call starts the processes again from `state`.

Checkpoints: every train/sft call ends with one (pipeline/checkpoint/), so
`resume_from` works from another process, and two `train(steps=3)` calls log what one
`train(steps=6)` logs. Without save_checkpoint the engine keeps its state in
`<log_dir>/checkpoints` (the last one only).

Compilation: the Engine is built from a `Job` (pipeline/api/job.py), plain data: the
builder's declarations frozen at `build()`, the compiled step and the training Topology;
it holds no reference to the builder, so changing the builder afterwards changes no
engine (build again). Each call builds its Topology from the training one by typed
replacement (`Job.train_topology`, `sft_topology`, `run_topology`), plans it once and
runs it; its data source is built once, beside the plan (runner.plan_run: the plan does
not build one to check `data`), handed to the job and closed when the call ends. `run`
sends the compiled step's own dataflow (so a logic with `actor.update` trains) and reads
the declared outputs where `CompiledStep.outputs` says they are (pipeline/api/results.py,
which also gives the shapes): per-sample values from the tensors the scheduler collects
(`CompiledStep.collect`), step-level ones (a loss) from the step's metrics. `sft`'s op
list is `job.SFT_OPS` (the step grammar has no SFT method yet).

Invariant: `step` is the number of RL steps whose effects are in `state` (the
checkpoint the next restart resumes from) and, while processes are up, in them; a call
that raises leaves `step` and `state` unchanged and stops the processes.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.config.loader import from_dict, to_dict
from hybridflow.config.schema import CheckpointConfig, Topology, ValidationConfig
from hybridflow.errors import ConfigError
from hybridflow.pipeline.api.job import Job
from hybridflow.pipeline.api.results import TrainResult, run_outputs, train_result
from hybridflow.pipeline.checkpoint import resume as ckpt
from hybridflow.pipeline.checkpoint.checkpointer import Checkpointer
from hybridflow.pipeline.plan.planner import Plan, build_plan
from hybridflow.pipeline.runtime.watch.rundir_lock import DirLock, release_all, take_locks
from hybridflow.pipeline.sources.datasets import (
    dataset_source,
    restore_stream_state,
    save_stream_states,
)

if TYPE_CHECKING:
    from hybridflow.pipeline.runtime.coordinator import RunResult
    from hybridflow.pipeline.runtime.jobs.validation import Validator
    from hybridflow.pipeline.runtime.session import Session
    from hybridflow.pipeline.sources.registry import DataSource

__all__ = ["Engine", "TrainResult"]


class Engine:
    """Runs a compiled job (see the module docstring)."""

    def __init__(self, job: Job, launcher: Any = None) -> None:
        self.job = job  # replaced by job.with_policy(...) after sft()
        self.settings = dict(job.settings)
        self.launcher = launcher
        self.log_dir = job.log_dir
        self.step = 0  # RL steps done
        self.state: str | None = None  # the checkpoint holding the current state
        self.save: CheckpointConfig | None = None
        self.history: list[dict[str, float]] = []
        self._session: Session | None = None
        self._last_validation: dict[str, Any] | None = None  # train(validation=)'s
        # log_dir and the checkpoint directory, held while the processes are up: one run
        # per directory (pipeline/runtime/watch/rundir_lock.py).
        self._locks: list[DirLock] = []

    # -- life time ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the stage processes (idempotent). A later call starts them again."""
        session, self._session = self._session, None
        if session is not None:
            session.close("engine closed")
        release_all(self._locks)
        self._locks = []

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pids(self) -> dict[str, int]:
        """Stage process name ("engine/0") -> pid, while processes are up; else {}."""
        return self._session.pids() if self._session is not None else {}

    @property
    def run_id(self) -> str | None:
        """The run id of the processes that are up (their shm segments and ipc dir)."""
        return self._session.run_id if self._session is not None else None

    # -- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(
        self, save_path: str | Path, save_interval: int = 0, keep_last: int = 3
    ) -> str | None:
        """Checkpoint into `save_path` every `save_interval` steps of later `train` calls
        and at their end, keeping the last `keep_last`. If the engine already trained,
        its current state is saved there now too; returns that directory (else None)."""
        cfg = CheckpointConfig(str(save_path), int(save_interval), int(keep_last))
        cfg.validate()
        self.save = cfg
        if self.state is None:
            return None
        src = Path(self.state)
        dst = Path(save_path) / src.name
        if src.resolve() != dst.resolve():
            tmp = Path(save_path) / f".tmp-copy-{src.name}"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(src, tmp)
            shutil.rmtree(dst, ignore_errors=True)
            tmp.rename(dst)
            pointer = Path(save_path) / ".tmp-latest"
            pointer.write_text(dst.name + "\n")
            pointer.replace(Path(save_path) / "latest")
            self.state = str(dst)
        return self.state

    def resume(self, resume_from: str | Path) -> str:
        """Continue from a checkpoint: "latest" (under save_checkpoint's path or the log
        dir's), a checkpoint directory, or a save directory."""
        base = self.save.save_dir if self.save else self._default_dir()
        path = ckpt.resolve(resume_from, base)
        meta = ckpt.read_meta(path)
        theirs = ckpt.stage_layout(meta.get("config", {}).get("stages") or {})
        ours = ckpt.stage_layout(to_dict(self.job.topology)["stages"])
        if theirs != ours:
            raise ConfigError(
                "resume_from",
                f"{str(path)!r} was written by stages {theirs}; this job has {ours} "
                "(a checkpoint resumes the same roles on the same processes)",
            )
        self.state, self.step = str(path), int(meta["step"])
        self.close()  # the processes restart from the chosen checkpoint at the next call
        return self.state

    def _default_dir(self) -> str:
        return str(self.log_dir / "checkpoints")

    # -- calls ----------------------------------------------------------------------------
    def train(
        self,
        dataset: Any = None,
        steps: int = 1,
        *,
        resume_from: str | Path | None = None,
        save_path: str | Path | None = None,
        save_interval: int | None = None,
        keep_last: int | None = None,
        validation: dict[str, Any] | ValidationConfig | None = None,
    ) -> TrainResult:
        """Run `steps` RL steps on `dataset` (a built-in task name such as "last_digit",
        "task:NAME", a .jsonl/.json/.parquet file or datasets directory, a list of
        prompt strings / records, or a torch Dataset / IterableDataset or Hugging Face
        Dataset / IterableDataset of records, read lazily in this process), continuing
        from the engine's state.

        `validation`: the YAML `validation:` section as a dict (or ValidationConfig):
        `{"source": test_set, "interval": 10, "before_train": True, "temperature": 0.0,
        "n": 1, "max_new_tokens": ..., "generations": 4, ...}`; `source` takes what
        `dataset` takes but objects. The held-out set is evaluated on the same processes
        at the steps it names (the policy after that many updates); the `val/` rows go
        to the metrics sinks and `TrainResult.validation`."""
        if save_path is not None:
            self.save_checkpoint(
                save_path, save_interval or 0, 3 if keep_last is None else keep_last
            )
        elif self.save is not None and (save_interval is not None or keep_last is not None):
            self.save = CheckpointConfig(
                self.save.save_dir,
                self.save.save_interval if save_interval is None else save_interval,
                self.save.keep_last if keep_last is None else keep_last,
            )
        if resume_from is not None:
            self.resume(resume_from)
        if steps < 1:
            raise ConfigError("steps", f"must be >= 1, got {steps}")
        job = self.job
        topo = job.train_topology(self.step + steps, dataset, self._validation(validation))
        restore_stream_state(topo, self.state)  # an HF stream resumes from its own state
        with self._planned(topo) as (plan, source):
            validator = self._validator(topo)
            try:
                # The job's processes are the training topology's: its plan launches them.
                res = self._job(
                    plan,
                    plan,
                    self.step,
                    self._checkpointer(self.step + steps - 1),
                    source,
                    validator=validator,
                )
            finally:
                if validator is not None:
                    validator.close()
        save_stream_states(topo, res.checkpoints)
        self.step += steps
        return self._result(res, topo, job)

    def validate(self, dataset: Any = None, **settings: Any) -> dict[str, float]:
        """Evaluate the current policy on a held-out set, without training: `dataset`
        (what `train` takes but objects; default: the last `train` call's validation
        source) and any `validation:` setting (`temperature`, `n`, `max_prompts`, ...)
        -> the `val/` metrics, at the engine's current step."""
        given = dict(self._last_validation or {})
        given.update(settings)
        if dataset is not None:
            given["source"] = dataset
        if "source" not in given:
            raise ConfigError("dataset", "give the held-out set to validate on")
        given.update(before_train=True, after_train=False, interval=0)
        validation = self._validation(given)
        assert validation is not None
        topo = self.job.validation_topology(validation)
        # The validation job reads its own set (the Validator's), never the training data.
        plan = build_plan(topo, check_devices=True, check_data=False)
        validator = self._validator(topo)
        assert validator is not None
        try:
            session = self._session_for(plan, None)
            try:
                metrics, _ = validator.run(session, self.step)
            except BaseException:
                self._session = None  # the session closed itself; the next call restarts
                raise
        finally:
            validator.close()
        return metrics

    def sft(
        self,
        dataset: Any = None,
        steps: int = 1,
        *,
        batch_size: int | None = None,
        lr: float | None = None,
        warmup_steps: int | None = None,
    ) -> TrainResult:
        """Supervised fine-tuning of the current policy on (prompt, response) pairs: a
        built-in task's ideal answers ("last_digit") or a file/records with
        prompt/response. The fine-tuned policy then replaces the initial one everywhere
        (actor, rollout, reference: the usual SFT -> RL pipeline; the processes restart
        from it at the next call) and RL starts from it at step 0. `lr` and
        `warmup_steps` replace the actor's for SFT only (RL keeps the declared ones)."""
        if steps < 1:
            raise ConfigError("steps", f"must be >= 1, got {steps}")
        job = self.job
        given = {"lr": lr, "warmup_steps": warmup_steps}
        overrides = {k: v for k, v in given.items() if v is not None}
        sft = job.sft_topology(dataset, steps, batch_size, overrides)
        cfg = CheckpointConfig(str(self.log_dir / "sft" / "checkpoints"), 0, 1)
        with self._planned(sft.topology) as (plan, source):
            launch = plan if sft.restart else None  # other actor options than the processes'
            res = self._job(plan, launch, 0, Checkpointer(cfg, steps - 1, job.extra()), source)
        policy = Path(res.checkpoints[-1]) / "policy"
        if sft.lora:
            policy = policy / "merged"
        self.job = job.with_policy(str(policy))  # every role reloads from it: a restart
        self.close()
        self.step, self.state = 0, None
        return self._result(res, sft.topology, job)

    def run(self, prompts: Sequence[str]) -> dict[str, Any]:
        """One step of the declared logic on `prompts` (each sampled n times, as the
        logic's `actor.generate(..., n=)` says) with the current policy. If the logic
        updates a role this is a training step like one of `train` (generate, score,
        reference, advantages, update, optimizer step, reshard; `step` advances, the
        metrics row is logged and a checkpoint ends it); otherwise nothing trains.
        -> {declared output: value}, keyed by exactly `define_training_step(outputs=)`
        (shapes in the module docstring; row i is prompt i)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts or not all(isinstance(p, str) and p for p in prompts):
            raise ConfigError("prompts", "give a non-empty list of non-empty prompt strings")
        job = self.job
        topo = job.run_topology(prompts, self.step)
        # Same processes, dataflow and links as the training topology: it launches them.
        step, trains = self.step, job.compiled.trains
        checkpointer = self._checkpointer(step) if trains else None
        with self._planned(topo) as (plan, source):
            res = self._job(plan, plan, step, checkpointer, source, collect=job.compiled.collect)
        if trains:
            self.step += 1
            self.history += [dict(m) for m in res.metrics]
        return run_outputs(job.compiled, res, step, prompts, job.declared.tokenizer_options())

    def export(self, directory: str | Path) -> Path:
        """The current policy as a transformers directory (save_pretrained); a LoRA
        actor's is a PEFT adapter directory (`peft.PeftModel.from_pretrained` on the base
        model loads it; `lora_export_merged: true` adds a save_pretrained `merged/`)."""
        if self.state is None:
            raise ConfigError("export", "nothing trained yet: call train() or sft() first")
        src = Path(self.state) / "policy"
        if not any((src / f).is_file() for f in ("config.json", "adapter_config.json")):
            raise ConfigError("export", f"{self.state} holds no exported policy")
        out = Path(directory)
        shutil.copytree(src, out, dirs_exist_ok=True)
        return out

    # -- internals ------------------------------------------------------------------------
    def _declared(self) -> Job:
        """The job this engine runs (its training topology and compiled step)."""
        return self.job

    def _checkpointer(self, last_step: int) -> Checkpointer:
        cfg = self.save or CheckpointConfig(self._default_dir(), 0, 1)
        return Checkpointer(cfg, last_step, self.job.extra())

    @contextlib.contextmanager
    def _planned(self, topo: Topology) -> Iterator[tuple[Plan, DataSource]]:
        """`topo`'s plan and its data source, each built once (runner.plan_run); the
        source is closed when the call ends."""
        from hybridflow.pipeline.runtime.runner import plan_run

        plan, source = plan_run(topo, check_devices=True)
        try:
            yield plan, source
        finally:
            source.close()

    def _job(
        self,
        plan: Plan,
        launch: Plan | None,
        start: int,
        checkpointer: Checkpointer | None,
        source: DataSource,
        *,
        collect: Sequence[str] = (),
        validator: Validator | None = None,
    ) -> RunResult:
        """Run `plan` as a job on the processes that are up, starting them first (from
        `launch`, else the training topology's plan) if none are up or they do not fit.
        `source`: the job's data source (the caller's, left open)."""
        from hybridflow.pipeline.runtime.runner import check_start

        check_start(plan.topology, start)
        session = self._session_for(plan, launch)
        try:
            if validator is None:
                res = session.run_job(
                    plan,
                    collect=tuple(collect),
                    start_step=start,
                    checkpointer=checkpointer,
                    driver_state=self.state,
                    source=source,
                )
            else:
                res = self._validated_job(session, plan, start, checkpointer, validator, source)
        except BaseException:
            self._session = None  # the session closed itself; the next call restarts
            self.close()
            raise
        if res.checkpoints:
            self.state = res.checkpoints[-1]
        return res

    def _session_for(self, plan: Plan, launch: Plan | None) -> Session:
        """The session a job of `plan` runs on: the one that is up if it fits, else a new
        one launched from `launch` (else the training topology's plan)."""
        from hybridflow.pipeline.runtime.runner import honour_log_level
        from hybridflow.pipeline.runtime.session import Session

        session = self._session
        if session is not None and session.mismatch(plan.topology):
            self.close()  # e.g. sft(lr=...): other actor options than the processes have
            session = None
        if session is None:
            if not self._locks:
                save = self.save.save_dir if self.save else self._default_dir()
                dirs = [("log_dir", self.log_dir), ("save_checkpoint.save_path", Path(save))]
                self._locks = take_locks(dirs, "Engine (Python API)")
            if launch is None:
                training = self.job.topology
                # Only its processes are used here: build() checked its data.
                launch = (
                    plan if training == plan.topology else build_plan(training, check_data=False)
                )
            honour_log_level(launch.topology.log_level)
            session = Session(launch, launcher=self.launcher, resume_dir=self.state)
            self._session = session
        return session

    def _validated_job(
        self,
        session: Session,
        plan: Plan,
        start: int,
        checkpointer: Checkpointer | None,
        validator: Validator,
        source: DataSource,
    ) -> RunResult:
        """Training steps cut at the validation points (pipeline/runtime/jobs/training.py),
        one set of metrics sinks for the whole call."""
        from hybridflow.pipeline.observe.metrics import make_sinks
        from hybridflow.pipeline.runtime.jobs.training import run_training
        from hybridflow.pipeline.runtime.session import run_dir_of

        topo = plan.topology
        sinks = make_sinks(topo.metrics.backends, run_dir_of(topo), topo, start)
        try:
            return run_training(
                session,
                plan,
                start_step=start,
                sinks=sinks,
                checkpointer=checkpointer,
                driver_state=self.state,
                validator=validator,
                source=source,
            )
        finally:
            for sink in sinks:
                with contextlib.suppress(Exception):
                    sink.close()

    def _validation(
        self, given: dict[str, Any] | ValidationConfig | None
    ) -> ValidationConfig | None:
        """`train(validation=...)` -> the topology's ValidationConfig (a dataset `source`
        as `train` takes it); remembered for `validate()`."""
        if given is None:
            return None
        if isinstance(given, ValidationConfig):
            given = to_dict(given)
        values = dict(given)
        if "source" in values:
            values["source"] = dataset_source(values["source"], self.log_dir)
        self._last_validation = dict(values)
        return from_dict(ValidationConfig, values, "validation")

    def _validator(self, topo: Topology) -> Validator | None:
        from hybridflow.pipeline.runtime.jobs.validation import Validator
        from hybridflow.pipeline.runtime.session import run_dir_of

        return Validator(topo, run_dir_of(topo)) if topo.validation is not None else None

    def _result(self, res: RunResult, topo: Topology, job: Job) -> TrainResult:
        result = train_result(res, topo, job.compiled)
        self.history += [dict(m) for m in result.metrics]
        return result

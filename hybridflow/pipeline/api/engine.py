"""The Engine: runs what a DataflowBuilder declared, on stage processes that stay up.

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
    fresh optimizer, and RL starts from it at step 0;
  - the builder's declarations changed (define_training_step, add_*, configure, ...).
`close()` does not end the Engine: a later call starts the processes again from `state`.

Checkpoints: every train/sft call ends with one (pipeline/checkpoint/), so
`resume_from` works from another process, and two `train(steps=3)` calls log what one
`train(steps=6)` logs. Without save_checkpoint the engine keeps its state in
`<log_dir>/checkpoints` (the last one only).

Compilation: the training step is compiled and placed once per builder state (cached
here); each call then builds its job's Topology from that one by typed replacement
(data, sizes, dataflow), plans it once and runs it. `run` sends the compiled step's own
dataflow (so a logic with `actor.update` trains) and reads the declared outputs where
`CompiledStep.outputs` says they are: per-sample values from the tensors the scheduler
collects (`CompiledStep.collect`), step-level ones (a loss) from the step's metrics.
`sft`'s op list is `_SFT_OPS` (the step grammar has no SFT method yet).

`run`'s result, for P prompts and n = samples per prompt (`actor.generate(..., n=)`):
text (`response`) is a list of P str, or of P lists of n str when n > 1; a per-sample
number (`reward_score`, `rewards`) is a tensor [P] (n = 1) or [P, n]; a per-token one
(log-probs, advantages) [P, R] or [P, n, R], right-padded with 0; the prompts are the
list given; a step-level value (`loss`, `kl_div`) is a 0-d tensor (NaN when the step
reported none, e.g. every row dropped by dynamic sampling). Row i is prompt i.

Invariant: `step` is the number of RL steps whose effects are in `state` (the
checkpoint the next restart resumes from) and, while processes are up, in them; a call
that raises leaves `step` and `state` unchanged and stops the processes.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hybridflow.config.fields import SEQUENCE_FIELDS
from hybridflow.config.loader import from_dict, to_dict
from hybridflow.config.schema import (
    CheckpointConfig,
    MetricsConfig,
    OpConfig,
    RunConfig,
    Topology,
    ValidationConfig,
)
from hybridflow.errors import ConfigError
from hybridflow.pipeline.checkpoint import resume as ckpt
from hybridflow.pipeline.checkpoint.checkpointer import Checkpointer
from hybridflow.pipeline.compiler.frontend import CompiledStep
from hybridflow.pipeline.compiler.ir import StepOutput
from hybridflow.pipeline.plan.planner import Plan, build_plan
from hybridflow.pipeline.runtime.watch.rundir_lock import DirLock, release_all, take_locks
from hybridflow.pipeline.sources.datasets import (
    dataset_source,
    restore_stream_state,
    save_stream_states,
)

if TYPE_CHECKING:
    from hybridflow.pipeline.runtime.coordinator import RunResult
    from hybridflow.pipeline.runtime.session import Session
    from hybridflow.pipeline.runtime.validation import Validator


class Declarations(Protocol):
    """What the Engine reads of the `DataflowBuilder` that made it (`builder.build`): the
    declarations it compiles and places, and the two it changes (`use_policy`). Typed here,
    not imported, so that builder -> engine is the only import between the two modules;
    the fingerprint of the declarations is `vars()` of the builder."""

    @property
    def dataset(self) -> Any: ...

    @property
    def step_spec(self) -> tuple[tuple[str, ...], tuple[str, ...], str] | None: ...

    compile: Callable[[], CompiledStep]
    topology: Callable[..., Topology]  # DataflowBuilder.topology's keyword settings

    def tokenizer_options(self) -> dict[str, Any]: ...

    def actor_options(self) -> dict[str, Any]: ...

    def use_policy(self, model_dir: str) -> None: ...


@dataclass
class TrainResult:
    """What one `train`/`sft` call did. `metrics`: one dict per step (step included);
    `outputs`: each declared output -> its value per step (a metric's mean)."""

    metrics: list[dict[str, float]]
    outputs: dict[str, list[float]] = field(default_factory=dict)
    checkpoint: str = ""  # the checkpoint the call ended with
    run_dir: str = ""
    validation: list[dict[str, float]] = field(default_factory=list)  # val/ rows, step incl.


_SFT_OPS = (
    OpConfig(role="actor", op="sft_update", inputs=SEQUENCE_FIELDS, phase="train"),
    OpConfig(role="actor", op="optimizer_step", scope="step", phase="train"),
    OpConfig(role="actor", op="reshard", scope="step", phase="reshard"),
)
_LOAD_WEIGHTS = OpConfig(role="rollout", op="load_weights", scope="step", phase="reshard")


@dataclass(frozen=True)
class _Declared:
    """The builder's declarations compiled and placed once (see `Engine._declared`)."""

    key: str  # fingerprint of the builder state it was made from
    topology: Topology  # the training topology: what the processes are started with
    compiled: CompiledStep


class Engine:
    """Runs what a DataflowBuilder declared (see the module docstring)."""

    def __init__(self, builder: Declarations, settings: dict[str, Any], launcher: Any) -> None:
        self.builder = builder
        self.settings = settings
        self.launcher = launcher
        self.log_dir = Path(settings["log_dir"])
        self.step = 0  # RL steps done
        self.state: str | None = None  # the checkpoint holding the current state
        self.save: CheckpointConfig | None = None
        self.history: list[dict[str, float]] = []
        self._session: Session | None = None
        self._cache: _Declared | None = None
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
        ours = ckpt.stage_layout(to_dict(self._declared().topology)["stages"])
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
        declared = self._declared()
        base = declared.topology
        topo = _validated(
            dataclasses.replace(
                base,
                run=dataclasses.replace(base.run, steps=self.step + steps),
                data=self._with_source(base, dataset),
                validation=self._validation(validation),
            )
        )
        plan = build_plan(topo, check_devices=True)
        restore_stream_state(topo, self.state)  # an HF stream resumes from its own state
        validator = self._validator(topo)
        try:
            # The job's processes are the training topology's: its plan launches them too.
            res = self._job(
                plan,
                plan,
                self.step,
                self._checkpointer(self.step + steps - 1),
                validator=validator,
            )
        finally:
            if validator is not None:
                validator.close()
        save_stream_states(topo, res.checkpoints)
        self.step += steps
        return self._result(res, topo, declared.compiled)

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
        declared = self._declared()
        topo = _validated(
            dataclasses.replace(declared.topology, validation=self._validation(given))
        )
        plan = build_plan(topo, check_devices=True)
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
        declared = self._declared()
        base = declared.topology
        size = batch_size or base.run.step_batch
        stages = dict(base.stages)
        given = {"lr": lr, "warmup_steps": warmup_steps}
        overrides = {k: v for k, v in given.items() if v is not None}
        # A LoRA actor's policy export is a PEFT adapter directory, which no role can load
        # as its model: SFT also writes the merged model (`policy/merged`), and RL starts
        # fresh adapters on top of it.
        lora = int(self.builder.actor_options().get("lora_rank", 0) or 0) > 0
        if lora:
            overrides["lora_export_merged"] = True
        if overrides:  # other actor options than the processes have: a restart
            name = next(s for s, c in stages.items() if "actor" in c.roles)
            actor = stages[name].roles["actor"]
            roles = {
                **stages[name].roles,
                "actor": dataclasses.replace(actor, options={**actor.options, **overrides}),
            }
            stages[name] = dataclasses.replace(stages[name], roles=roles)
        hosts = base.role_stage()
        apart = "rollout" in hosts and hosts["rollout"] != hosts["actor"]
        chosen = dataset if dataset is not None else self.builder.dataset
        topo = _validated(
            dataclasses.replace(
                base,
                name=f"{base.name}-sft",
                stages=stages,
                run=RunConfig(
                    steps=steps,
                    step_batch=size,
                    micro_batch=base.run.micro_batch if size % base.run.micro_batch == 0 else size,
                ),
                data=dataclasses.replace(
                    base.data,
                    source="sft",
                    fields=SEQUENCE_FIELDS,
                    options={
                        "source": dataset_source(chosen, self.log_dir),
                        **self.builder.tokenizer_options(),
                    },
                ),
                # Weights stream to a rollout in another process as after an RL step.
                dataflow=_SFT_OPS + ((_LOAD_WEIGHTS,) if apart else ()),
                run_dir=str(self.log_dir / "sft"),
            )
        )
        plan = build_plan(topo, check_devices=True)
        launch = plan if overrides else None
        cfg = CheckpointConfig(str(self.log_dir / "sft" / "checkpoints"), 0, 1)
        res = self._job(plan, launch, 0, Checkpointer(cfg, steps - 1, self._extra()))
        policy = Path(res.checkpoints[-1]) / "policy"
        if lora:
            policy = policy / "merged"
        self.builder.use_policy(str(policy))  # changes the declarations: a restart
        self.close()
        self.step, self.state = 0, None
        return self._result(res, topo, declared.compiled)

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
        declared = self._declared()
        base, compiled = declared.topology, declared.compiled
        n, trains = compiled.samples_per_prompt, compiled.trains
        size = len(prompts) * n
        # The declared streaming unit when it fits (groups whole), else one micro-batch.
        mb = base.run.micro_batch
        mb = mb if size % mb == 0 and mb % n == 0 else size
        topo = _validated(
            dataclasses.replace(
                base,
                name=base.name if trains else f"{base.name}-generate",
                run=dataclasses.replace(
                    base.run, steps=self.step + 1, step_batch=size, micro_batch=mb
                ),
                data=dataclasses.replace(
                    base.data,
                    options={
                        **base.data.options,
                        "source": dataset_source(prompts, self.log_dir),
                        "shuffle": False,  # one epoch of the prompts in order: row i = prompt i
                    },
                ),
                # A training step is logged with the others; a generation leaves no trace.
                metrics=base.metrics if trains else MetricsConfig(backends=("null",)),
                run_dir=base.run_dir if trains else str(self.log_dir / "generate"),
            )
        )
        plan = build_plan(topo, check_devices=True)
        # Same processes, dataflow and links as the training topology: it launches them.
        checkpointer = self._checkpointer(self.step) if trains else None
        res = self._job(plan, plan, self.step, checkpointer, collect=compiled.collect)
        collected = {k: _cat(v) for k, v in res.collected.get(self.step, {}).items()}
        row = res.metrics[-1] if res.metrics else {}
        if trains:
            self.step += 1
            self.history += [dict(m) for m in res.metrics]
        return {
            name: self._output(out, prompts, n, collected, row)
            for name, out in compiled.outputs.items()
        }

    def _output(
        self,
        out: StepOutput,
        prompts: list[str],
        n: int,
        collected: dict[str, Any],
        row: dict[str, float],
    ) -> Any:
        """One declared output of a `run` step (see the module docstring for shapes)."""
        import torch

        if out.kind == "prompt":
            return list(prompts)
        if not out.tensor:  # a step-level value: the update's metric
            return torch.tensor(row.get(out.metric, math.nan), dtype=torch.float32)
        value = collected[out.tensor]  # [P * n, ...], prompt i's samples on rows i*n..
        if out.kind != "response":
            return value.reshape(len(prompts), n, *value.shape[1:]) if n > 1 else value
        from hybridflow.data.batching import unpad
        from hybridflow.models.loader import load_tokenizer

        opts = self.builder.tokenizer_options()
        tok = load_tokenizer(opts.get("tokenizer"), opts.get("model"))
        texts = [
            tok.decode(r, skip_special_tokens=True)
            for r in unpad(value, collected["response_mask"])
        ]
        return texts if n == 1 else [texts[i : i + n] for i in range(0, len(texts), n)]

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
    def _declared(self) -> _Declared:
        """The training topology and compiled step of the builder as it is now; compiled
        and placed again only when the builder's declarations changed."""
        key = repr((sorted(vars(self.builder).items()), sorted(self.settings.items())))
        if self._cache is None or self._cache.key != key:
            compiled = self.builder.compile()
            topo = self.builder.topology(**self.settings)
            self._cache = _Declared(key, topo, compiled)
        return self._cache

    def _with_source(self, base: Topology, dataset: Any) -> Any:
        """`base.data` reading `dataset` (None: the builder's default dataset)."""
        if dataset is None:
            return base.data
        source = dataset_source(dataset, self.log_dir)
        return dataclasses.replace(base.data, options={**base.data.options, "source": source})

    def _checkpointer(self, last_step: int) -> Checkpointer:
        cfg = self.save or CheckpointConfig(self._default_dir(), 0, 1)
        return Checkpointer(cfg, last_step, self._extra())

    def _extra(self) -> dict[str, Any]:
        step = self.builder.step_spec
        return {"logic": step[2], "inputs": list(step[0]), "outputs": list(step[1])} if step else {}

    def _job(
        self,
        plan: Plan,
        launch: Plan | None,
        start: int,
        checkpointer: Checkpointer | None,
        *,
        collect: Sequence[str] = (),
        validator: Validator | None = None,
    ) -> RunResult:
        """Run `plan` as a job on the processes that are up, starting them first (from
        `launch`, else the training topology's plan) if none are up or they do not fit."""
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
                )
            else:
                res = self._validated_job(session, plan, start, checkpointer, validator)
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
                declared = self._declared().topology
                launch = plan if declared == plan.topology else build_plan(declared)
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
    ) -> RunResult:
        """Training steps cut at the validation points (pipeline/runtime/training.py),
        one set of metrics sinks for the whole call."""
        import contextlib

        from hybridflow.pipeline.observe.metrics import make_sinks
        from hybridflow.pipeline.runtime.session import run_dir_of
        from hybridflow.pipeline.runtime.training import run_training

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
        from hybridflow.pipeline.runtime.session import run_dir_of
        from hybridflow.pipeline.runtime.validation import Validator

        return Validator(topo, run_dir_of(topo)) if topo.validation is not None else None

    def _result(self, res: RunResult, topo: Topology, compiled: CompiledStep) -> TrainResult:
        rows = [dict(m) for m in res.metrics]
        self.history += rows
        outputs: dict[str, list[float]] = {}
        for name, out in compiled.outputs.items():
            if out.metric:
                outputs[name] = [row.get(out.metric, math.nan) for row in rows]
        return TrainResult(
            rows,
            outputs,
            res.checkpoints[-1] if res.checkpoints else "",
            str(topo.run_dir),
            validation=[dict(v) for v in res.validation],
        )


def _validated(topo: Topology) -> Topology:
    """A Topology made by `dataclasses.replace`, checked as if it had been loaded."""
    return from_dict(Topology, to_dict(topo))


def _cat(parts: list[Any]) -> Any:
    from hybridflow.pipeline.runtime.scheduler import concat_rows

    return concat_rows(list(parts))

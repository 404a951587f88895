"""The Engine: runs what a DataflowBuilder declared, one pipeline run per call.

    engine = df.build(...)                       (hybridflow.pipeline.api.builder)
    engine.train(dataset, steps=N)               RL steps: run_topology(topology of the job,
                                                 start_step = steps done, resume_dir = state)
    engine.sft(dataset, steps=N)                 actor.sft_update steps, then the exported
                                                 policy replaces the initial model
    engine.run(prompts)                          rollout.generate + reward.score only
    engine.save_checkpoint(path, interval, keep) where and how often train() checkpoints
    engine.resume("latest" | path)               continue a checkpointed job

State between calls lives on disk: every train/sft call ends with a checkpoint
(pipeline/checkpoint.py) and the next call starts its stage processes from it, so two
`train(steps=3)` calls log what one `train(steps=6)` logs, and `run` after training
samples the trained policy. Without save_checkpoint the engine keeps its state in
`<log_dir>/checkpoints` (the last one only).

Invariant: `step` is the number of RL steps whose effects are in `state` (the
checkpoint the next call resumes from); a call that raises leaves both unchanged.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.config.loader import to_dict
from hybridflow.config.schema import Topology, load_topology
from hybridflow.errors import ConfigError
from hybridflow.pipeline.checkpoint import store as ckpt
from hybridflow.pipeline.sources.datasets import dataset_source

if TYPE_CHECKING:
    from hybridflow.pipeline.api.builder import DataflowBuilder


@dataclass
class TrainResult:
    """What one `train`/`sft` call did. `metrics`: one dict per step (step included);
    `outputs`: each declared output -> its value per step (a metric's mean)."""

    metrics: list[dict[str, float]]
    outputs: dict[str, list[float]] = field(default_factory=dict)
    checkpoint: str = ""  # the checkpoint the call ended with
    run_dir: str = ""


_GENERATE_AND_SCORE = (("rollout", "generate"), ("reward", "score"))


class Engine:
    """Runs what a DataflowBuilder declared (see the module docstring)."""

    def __init__(self, builder: DataflowBuilder, settings: dict[str, Any], launcher: Any) -> None:
        self.builder = builder
        self.settings = settings
        self.launcher = launcher
        self.log_dir = Path(settings["log_dir"])
        self.step = 0  # RL steps done
        self.state: str | None = None  # the checkpoint holding the current state
        self.save: ckpt.CheckpointConfig | None = None
        self.history: list[dict[str, float]] = []

    # -- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(
        self, save_path: str | Path, save_interval: int = 0, keep_last: int = 3
    ) -> str | None:
        """Checkpoint into `save_path` every `save_interval` steps of later `train` calls
        and at their end, keeping the last `keep_last`. If the engine already trained,
        its current state is saved there now too; returns that directory (else None)."""
        cfg = ckpt.CheckpointConfig(str(save_path), int(save_interval), int(keep_last))
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
        theirs = _layout(meta.get("config", {}).get("stages") or {})
        ours = _layout(to_dict(self.builder.topology(**self.settings))["stages"])
        if theirs != ours:
            raise ConfigError(
                "resume_from",
                f"{str(path)!r} was written by stages {theirs}; this job has {ours} "
                "(a checkpoint resumes the same roles on the same processes)",
            )
        self.state, self.step = str(path), int(meta["step"])
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
    ) -> TrainResult:
        """Run `steps` RL steps on `dataset` (a built-in task name such as "last_digit",
        "task:NAME", a .jsonl/.json/.parquet file or datasets directory, or a list of
        prompt strings / records), continuing from the engine's state."""
        if save_path is not None:
            self.save_checkpoint(
                save_path, save_interval or 0, 3 if keep_last is None else keep_last
            )
        elif self.save is not None and (save_interval is not None or keep_last is not None):
            self.save = ckpt.CheckpointConfig(
                self.save.save_dir,
                self.save.save_interval if save_interval is None else save_interval,
                self.save.keep_last if keep_last is None else keep_last,
            )
        if resume_from is not None:
            self.resume(resume_from)
        if steps < 1:
            raise ConfigError("steps", f"must be >= 1, got {steps}")
        topo = self.builder.topology(dataset=dataset, steps=self.step + steps, **self.settings)
        res = self._run(topo, self.step, self._checkpointer(self.step + steps - 1))
        self.step += steps
        return self._result(res, topo)

    def sft(
        self,
        dataset: Any = None,
        steps: int = 1,
        *,
        batch_size: int | None = None,
        lr: float | None = None,
    ) -> TrainResult:
        """Supervised fine-tuning of the actor on (prompt, response) pairs: a built-in
        task's ideal answers ("last_digit") or a file/records with prompt/response. The
        fine-tuned policy then replaces the initial one everywhere (actor, rollout,
        reference: the usual SFT -> RL pipeline) and RL starts from it at step 0."""
        if steps < 1:
            raise ConfigError("steps", f"must be >= 1, got {steps}")
        base = self.builder.topology(steps=steps, **self.settings)
        actor_stage = next(s for s, c in base.stages.items() if "actor" in c.roles)
        size = batch_size or base.run.step_batch
        stages = to_dict(base)["stages"]
        if lr is not None:
            stages[actor_stage]["roles"]["actor"]["options"]["lr"] = lr
        chosen = dataset if dataset is not None else self.builder.dataset
        raw = to_dict(base) | {
            "name": f"{base.name}-sft",
            "run": {
                "steps": steps,
                "step_batch": size,
                "micro_batch": base.run.micro_batch if size % base.run.micro_batch == 0 else size,
            },
            "data": {
                "source": "sft",
                "fields": ["prompt_ids", "prompt_mask", "response_ids", "response_mask"],
                "options": {
                    "source": dataset_source(chosen, self.log_dir),
                    **self.builder.tokenizer_options(),
                },
            },
            "stages": stages,
            "dataflow": [
                {
                    "role": "actor",
                    "op": "sft_update",
                    "inputs": ["prompt_ids", "prompt_mask", "response_ids", "response_mask"],
                    "phase": "train",
                },
                {"role": "actor", "op": "optimizer_step", "scope": "step", "phase": "train"},
                {"role": "actor", "op": "reshard", "scope": "step", "phase": "reshard"},
            ],
            "run_dir": str(self.log_dir / "sft"),
        }
        topo = load_topology(raw)
        cfg = ckpt.CheckpointConfig(str(self.log_dir / "sft" / "checkpoints"), 0, 1)
        res = self._run(topo, 0, ckpt.Checkpointer(cfg, steps - 1, self._extra()), resume=False)
        policy = Path(res.checkpoints[-1]) / "policy"
        self.builder.use_policy(str(policy))
        self.step, self.state = 0, None
        return self._result(res, topo)

    def run(self, prompts: Sequence[str]) -> list[dict[str, Any]]:
        """Generate one response per prompt with the current policy and score it.
        -> [{"prompt", "response", "reward"}] in prompt order."""
        from hybridflow.data.batching import unpad
        from hybridflow.models.loader import load_tokenizer

        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts or not all(isinstance(p, str) and p for p in prompts):
            raise ConfigError("prompts", "give a non-empty list of non-empty prompt strings")
        base = self.builder.topology(dataset=prompts, steps=self.step + 1, **self.settings)
        if "reward" not in {r for c in base.stages.values() for r in c.roles}:
            raise ConfigError("run", "generate-and-score needs a reward (add_reward_*)")
        raw = to_dict(base)
        n = len(prompts)
        raw["name"] = f"{base.name}-generate"
        raw["run"] = {"steps": self.step + 1, "step_batch": n, "micro_batch": n}
        raw["data"]["options"]["samples_per_prompt"] = 1
        raw["data"]["options"]["shuffle"] = False
        raw["data"]["fields"] = [f for f in raw["data"]["fields"] if f != "group_index"]
        keep = [op for op in raw["dataflow"] if (op["role"], op["op"]) in _GENERATE_AND_SCORE]
        for op in keep:
            op["inputs"] = [i for i in op["inputs"] if i != "group_index"]
        raw["dataflow"] = keep
        # Processes that host neither the sampler nor the reward are not started.
        raw["stages"] = {
            name: cfg
            for name, cfg in raw["stages"].items()
            if {"rollout", "reward"} & set(cfg["roles"])
        }
        raw["metrics"] = {"backends": ["null"]}
        raw["run_dir"] = str(self.log_dir / "generate")
        topo = load_topology(raw)
        collect = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rewards")
        res = self._run(topo, self.step, None, collect=collect)
        got = {k: _cat(v) for k, v in res.collected[self.step].items()}
        opts = self.builder.tokenizer_options()
        tok = load_tokenizer(opts.get("tokenizer"), opts.get("model"))
        responses = unpad(got["response_ids"], got["response_mask"])
        # The source keeps the prompts' order (shuffle off, one epoch per call): row i is
        # prompt i.
        return [
            {"prompt": p, "response": tok.decode(r, skip_special_tokens=True), "reward": float(s)}
            for p, r, s in zip(prompts, responses, got["rewards"].tolist(), strict=True)
        ]

    def export(self, directory: str | Path) -> Path:
        """The current policy as a transformers directory (save_pretrained)."""
        if self.state is None:
            raise ConfigError("export", "nothing trained yet: call train() or sft() first")
        src = Path(self.state) / "policy"
        if not (src / "config.json").is_file():
            raise ConfigError("export", f"{self.state} holds no exported policy")
        out = Path(directory)
        shutil.copytree(src, out, dirs_exist_ok=True)
        return out

    # -- internals ------------------------------------------------------------------------
    def _checkpointer(self, last_step: int) -> ckpt.Checkpointer:
        cfg = self.save or ckpt.CheckpointConfig(self._default_dir(), 0, 1)
        return ckpt.Checkpointer(cfg, last_step, self._extra())

    def _extra(self) -> dict[str, Any]:
        step = self.builder.step_spec
        return {"logic": step[2], "inputs": list(step[0]), "outputs": list(step[1])} if step else {}

    def _run(
        self,
        topo: Topology,
        start: int,
        checkpointer: ckpt.Checkpointer | None,
        *,
        collect: Sequence[str] = (),
        resume: bool = True,
    ) -> Any:
        from hybridflow.pipeline.runtime.runner import run_topology

        resume_dir = self.state if resume else None
        if self.settings.get("multi_host"):  # the launcher places processes on hosts
            self.launcher.assign_nodes(self.builder.nodes(**self.settings))
        res = run_topology(
            topo,
            collect=tuple(collect),
            launcher=self.launcher,
            start_step=start,
            resume_dir=resume_dir,
            checkpointer=checkpointer,
        )
        if res.checkpoints:
            self.state = res.checkpoints[-1]
        return res

    def _result(self, res: Any, topo: Topology) -> TrainResult:
        rows = [dict(m) for m in res.metrics]
        self.history += rows
        outputs: dict[str, list[float]] = {}
        assert self.builder.step_spec is not None
        compiled = self.builder.compile()
        for name, metric in compiled.outputs.items():
            if metric:
                outputs[name] = [row.get(metric, math.nan) for row in rows]
        return TrainResult(
            rows, outputs, res.checkpoints[-1] if res.checkpoints else "", str(topo.run_dir)
        )


def _layout(stages: Mapping[str, Any]) -> dict[str, Any]:
    """stage -> (replicas, sorted roles): what a checkpoint's parts are keyed by."""
    return {
        name: (int(cfg.get("replicas", 1)), sorted(cfg.get("roles", {})))
        for name, cfg in stages.items()
    }


def _cat(parts: list[Any]) -> Any:
    from hybridflow.pipeline.runtime.scheduler import concat_rows

    return concat_rows(list(parts))

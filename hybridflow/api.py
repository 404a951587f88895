"""The programming model users meet first: `DataflowBuilder` (declare) and `Engine` (run).

    df = DataflowBuilder()
    df.add_actor(model_name="tiny", device_mapping="cpu")
    df.add_reward_function("hybridflow.data.tasks:last_digit_reward")
    df.define_training_step(inputs=["prompt"], outputs=["loss", "rewards"], logic=\"\"\"
    response = actor.generate(prompt, n=4)
    reward_score = reward.score(prompt, response)
    loss = grpo_loss(reward_score)
    actor.update(loss)
    \"\"\")
    engine = df.build(log_level="INFO", metrics_backend="jsonl", log_dir="runs/demo")
    engine.train("last_digit", steps=10)
    engine.run(["last:123="])

"Logically unified declaration, physically distributed on demand": the builder holds
declarations only (roles, models, device mappings, the step logic). `build()` compiles
the logic (pipeline/compiler.py), places roles on processes (pipeline/placement.py) and
checks the result as a Topology, so every mistake surfaces there, before any process
starts. `to_yaml()` writes that Topology: `hybridflow run FILE` runs the same plan.

The Engine runs each call (`train`, `sft`, `run`) as one pipeline run
(`run_topology`: stage processes, coordinator, teardown). Its state between calls lives
on disk: every call ends with a checkpoint (pipeline/checkpoint.py) and the next call
resumes from it, so `train(...)` twice equals one longer `train`, and `run(prompts)`
after training samples from the trained policy. `save_checkpoint(save_path,
save_interval, keep_last)` chooses where and how often; `resume_from="latest"` or a
path continues an earlier run, even from another process.

Invariants: the builder never imports torch (build() does, to count GPUs); nothing the
user wrote is executed (the logic is parsed, reward functions are imported by name in
their stage process); one seed drives every stage.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.config.loader import to_dict
from hybridflow.config.schema import LOG_LEVELS, Topology, load_topology
from hybridflow.errors import ConfigError
from hybridflow.pipeline import checkpoint as ckpt
from hybridflow.pipeline.compiler import CompiledStep, compile_step
from hybridflow.pipeline.placement import normalize, place

log = logging.getLogger("hybridflow.api")

# Options of the actor that belong to the rollout engine (sampling) instead.
_ROLLOUT_KEYS = ("max_new_tokens", "top_p", "top_k", "max_batch_size", "stop_on_eos")
# Model options every role built from the actor's model shares.
_MODEL_KEYS = ("tokenizer", "dtype", "init_seed", "init_device", "autocast_bf16", "model_overrides")
_LIVENESS = {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 30.0, "startup_timeout_s": 180.0}
_RUN_KEYS = ("step_batch", "micro_batch", "max_offpolicy_steps", "mode", "max_inflight")
_TIMING = ("timing/", "compute/", "perf/", "checkpoint/", "rollout/gen_s", "rollout/tokens_per_s")


@dataclass
class _Role:
    backend: str
    options: dict[str, Any]
    mapping: Any  # as the user wrote it; None: the default for the role


@dataclass
class TrainResult:
    """What one `train`/`sft` call did. `metrics`: one dict per step (step included);
    `outputs`: each declared output -> its value per step (a metric's mean)."""

    metrics: list[dict[str, float]]
    outputs: dict[str, list[float]] = field(default_factory=dict)
    checkpoint: str = ""  # the checkpoint the call ended with
    run_dir: str = ""


class DataflowBuilder:
    """Declarations of one RL job (see the module docstring)."""

    def __init__(self, name: str = "hybridflow", *, seed: int = 0) -> None:
        self.name, self.seed = name, seed
        self._roles: dict[str, _Role] = {}
        self._step: tuple[tuple[str, ...], tuple[str, ...], str] | None = None
        self._run: dict[str, Any] = {"step_batch": 32, "micro_batch": 16}
        self._data: dict[str, Any] = {}

    # -- roles --------------------------------------------------------------------------
    def add_actor(
        self,
        model_name: str,
        device_mapping: Any = None,
        use_vllm: bool = False,
        *,
        rollout: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> DataflowBuilder:
        """The policy: its training weights (`actor`) and its sampler (`rollout`, hf or
        vLLM), always colocated (the hybrid engine reshards in process). `options` are
        the actor's (lr, grad_clip, ppo_epochs, ...); sampling keys (max_new_tokens,
        top_p, top_k, temperature) go to the rollout, `temperature` to both."""
        mapping = _role_mapping(device_mapping, "actor", ("actor", "rollout"))
        actor = {k: v for k, v in options.items() if k not in _ROLLOUT_KEYS}
        roll = {k: v for k, v in options.items() if k in _ROLLOUT_KEYS or k in _MODEL_KEYS}
        if "temperature" in options:
            roll["temperature"] = options["temperature"]
        roll.update(rollout or {})
        self._add("actor", "hf", {"model": model_name, **actor}, mapping)
        self._roles["rollout"] = _Role(
            "vllm" if use_vllm else "hf", {"model": model_name, **roll}, None
        )
        return self

    def add_critic(
        self, model_name: str, device_mapping: Any = None, **options: Any
    ) -> DataflowBuilder:
        """A value model (a value head on `model_name`'s trunk) for GAE."""
        mapping = _role_mapping(device_mapping, "critic", ("critic",))
        return self._add("critic", "hf", {"model": model_name, **options}, mapping)

    def add_reference_model(
        self, model_name: str, device_mapping: Any = None, **options: Any
    ) -> DataflowBuilder:
        """The frozen initial policy (`ref` in the logic), for the KL term."""
        mapping = _role_mapping(device_mapping, "reference", ("ref", "reference"))
        return self._add("reference", "hf", {"model": model_name, **options}, mapping)

    def add_reward_model(
        self, model_name: str, device_mapping: Any = None, **options: Any
    ) -> DataflowBuilder:
        """A sequence-classification reward model (`reward` in the logic)."""
        mapping = _role_mapping(device_mapping, "reward", ("reward", "rm"))
        return self._add("reward", "model", {"model": model_name, **options}, mapping)

    def add_reward_function(
        self, function: str, device_mapping: Any = None, **options: Any
    ) -> DataflowBuilder:
        """A Python reward function `package.module:function` (batched signature, see
        hybridflow.stages.reward.function); imported by name in its stage process."""
        if not isinstance(function, str) or ":" not in function:
            raise ConfigError(
                "add_reward_function", f"give 'package.module:function', got {function!r}"
            )
        mapping = _role_mapping(device_mapping, "reward", ("reward",))
        return self._add("reward", "function", {"function": function, **options}, mapping)

    def add_reward_service(
        self,
        url: str,
        protocol: str = "http",
        device_mapping: Any = None,
        **options: Any,
    ) -> DataflowBuilder:
        """An external reward service (docs/reward-service.md): `protocol` "http" (url
        http://host:port/score) or "zmq" (url tcp://host:port). Options: max_batch,
        max_concurrency, timeout_s, retries, backoff_s, token_env, on_failure, ..."""
        if protocol not in ("http", "zmq"):
            raise ConfigError(
                "add_reward_service.protocol", f"must be 'http' or 'zmq', got {protocol!r}"
            )
        key = "url" if protocol == "http" else "endpoint"
        mapping = _role_mapping(device_mapping, "reward", ("reward",))
        return self._add("reward", protocol, {key: url, **options}, mapping)

    def _add(
        self, role: str, backend: str, options: dict[str, Any], mapping: Any
    ) -> DataflowBuilder:
        if role in self._roles:
            raise ConfigError(role, f"a {role} was already added; a job has one of each role")
        if mapping is not None:
            normalize(role, mapping)  # fail on the call that wrote it
        self._roles[role] = _Role(backend, options, mapping)
        return self

    # -- the step -----------------------------------------------------------------------
    def define_training_step(
        self, inputs: Sequence[str], outputs: Sequence[str], logic: str
    ) -> DataflowBuilder:
        """The step as Python-like logic (compiled, never executed: pipeline/compiler.py)."""
        if isinstance(inputs, str) or isinstance(outputs, str):
            raise ConfigError("define_training_step", "inputs and outputs are lists of names")
        self._step = (tuple(inputs), tuple(outputs), str(logic))
        self.compile()  # errors point at the logic now, not at build()
        return self

    def configure(self, **run: Any) -> DataflowBuilder:
        """Run sizes: step_batch (samples per step), micro_batch (the streaming unit),
        max_offpolicy_steps, mode ("streamed" | "sequential"), max_inflight."""
        bad = sorted(set(run) - set(_RUN_KEYS))
        if bad:
            raise ConfigError(
                f"configure.{bad[0]}", f"unknown setting; known: {', '.join(_RUN_KEYS)}"
            )
        self._run.update(run)
        return self

    def set_data(self, dataset: Any = None, **options: Any) -> DataflowBuilder:
        """The default dataset (see `Engine.train`) and prompt options (task_size,
        max_prompt_length, chat_template, ...) of the data source."""
        if dataset is not None:
            self._data["dataset"] = dataset
        self._data.update(options)
        return self

    def compile(self) -> CompiledStep:
        if self._step is None:
            raise ConfigError("define_training_step", "no training step defined yet")
        inputs, outputs, logic = self._step
        return compile_step(logic, inputs, outputs, self._roles)

    # -- build ----------------------------------------------------------------------------
    def topology(
        self,
        *,
        dataset: Any = None,
        steps: int = 1,
        log_dir: str | Path | None = None,
        metrics_backend: str | Sequence[str] | None = "jsonl",
        log_level: str = "WARNING",
        device_mapping: Mapping[str, Any] | None = None,
        cuda_count: int | None = None,
        multi_host: bool = False,
    ) -> Topology:
        """The Topology these declarations stand for (validated)."""
        if "actor" not in self._roles:
            raise ConfigError("add_actor", "a job needs an actor (df.add_actor)")
        compiled = self.compile()
        stages = self._stages(compiled, device_mapping or {}, cuda_count, multi_host)
        data = self._data_config(compiled, dataset, log_dir)
        backends = _backends(metrics_backend)
        if log_level not in LOG_LEVELS:
            raise ConfigError(
                "log_level", f"must be one of {', '.join(LOG_LEVELS)}; got {log_level!r}"
            )
        raw = {
            "name": self.name,
            "seed": self.seed,
            "run": {"steps": steps, **self._run},
            "data": data,
            "stages": stages,
            "dataflow": [to_dict(op) for op in compiled.dataflow],
            "liveness": dict(_LIVENESS),
            "metrics": {"backends": backends},
            "log_level": log_level,
            "run_dir": str(log_dir) if log_dir else "",
        }
        return load_topology(raw)

    def _stages(
        self,
        compiled: CompiledStep,
        overrides: Mapping[str, Any],
        cuda_count: int | None,
        multi_host: bool,
    ) -> dict[str, Any]:
        options = self._role_options(compiled)
        gpu = _cuda_count() if cuda_count is None else cuda_count
        default = "cuda:0" if gpu else "cpu"
        actor_map = self._roles["actor"].mapping or default
        mappings: dict[str, Any] = {}
        for role, spec in self._roles.items():
            if role == "rollout":
                continue
            mapping = spec.mapping
            if mapping is None:
                # Hybrid engine by default: the reference shares the actor's devices. On a
                # CPU-only machine the critic and reward get processes of their own (CPU
                # slots), as in the bundled presets; a reward function never needs a GPU.
                if role == "reference" or (
                    role in ("critic", "reward") and gpu and spec.backend in ("hf", "model")
                ):
                    mapping = actor_map
                elif role == "critic":
                    mapping = "cpu:1"
                else:
                    mapping = "cpu:2"
            mappings[role] = mapping
        for role, mapping in overrides.items():
            runtime = {"ref": "reference", "rm": "reward"}.get(role, role)
            if runtime == "rollout":
                raise ConfigError(
                    "device_mapping.rollout",
                    "the rollout always shares the actor's devices (hybrid engine); map the actor",
                )
            if runtime not in mappings:
                raise ConfigError(
                    f"device_mapping.{role}", f"no such role here; roles: {', '.join(mappings)}"
                )
            mappings[runtime] = mapping
        slots = {role: normalize(role, m) for role, m in mappings.items()}
        slots["rollout"] = slots["actor"]
        stages = {}
        for sp in place(slots, cuda_count=gpu, multi_host=multi_host):
            name = "engine" if "rollout" in sp.roles else sp.name
            stages[name] = {
                "replicas": sp.replicas,
                "devices": sp.devices,
                "roles": {
                    r: {"backend": self._roles[r].backend, "options": options[r]} for r in sp.roles
                },
            }
        return stages

    def _role_options(self, compiled: CompiledStep) -> dict[str, dict[str, Any]]:
        out = {role: dict(spec.options) for role, spec in self._roles.items()}
        actor = out["actor"]
        shared = {k: actor[k] for k in _MODEL_KEYS if k in actor}
        if "temperature" in actor:
            shared["temperature"] = actor["temperature"]
        for role in ("rollout", "reference"):
            if role in out and out[role].get("model") == actor["model"]:
                out[role] = {**shared, **out[role]}
        reward = out.get("reward")
        if reward is not None and "tokenizer" not in reward and "model" not in reward:
            backend = self._roles["reward"].backend
            if backend == "function":  # decodes text with the actor's tokenizer
                reward.update(self._tokenizer_options())
            elif backend in ("http", "zmq"):  # services get text too
                model = str(actor["model"])
                reward["tokenizer"] = actor.get("tokenizer") or (
                    model if Path(model).is_dir() else "builtin"
                )
        # The sampler's log-probs stand for the actor's: one temperature for the policy.
        temp = compiled.role_options.get("rollout", {}).get("temperature")
        if temp:
            for role in ("actor", "reference"):
                if role in out and "temperature" not in self._roles[role].options:
                    out[role]["temperature"] = temp
        for role, implied in compiled.role_options.items():
            if role == "data":
                continue
            target = out.setdefault(role, {})
            for key, value in implied.items():
                given = self._roles[role].options.get(key) if role in self._roles else None
                if given is not None and given != value:
                    raise ConfigError(
                        f"{role}.{key}",
                        f"{given!r} conflicts with the training step's logic, which implies "
                        f"{value!r}; set it in one place",
                    )
                target[key] = value
        return out

    def _tokenizer_options(self) -> dict[str, Any]:
        """Where the actor's tokenizer comes from, for roles that only decode text."""
        actor = self._roles["actor"].options
        if actor.get("tokenizer"):
            return {"tokenizer": actor["tokenizer"]}
        if not Path(str(actor["model"])).is_dir():
            return {"tokenizer": "builtin"}  # presets use the built-in tokenizer
        return {"model": actor["model"]}

    def _data_config(
        self, compiled: CompiledStep, dataset: Any, log_dir: str | Path | None
    ) -> dict[str, Any]:
        opts = {k: v for k, v in self._data.items() if k != "dataset"}
        chosen = dataset if dataset is not None else self._data.get("dataset", "last_digit")
        source = _dataset_source(chosen, Path(log_dir) if log_dir else None)
        samples = compiled.role_options.get("data", {}).get("samples_per_prompt", 1)
        return {
            "source": "prompts",
            "fields": list(compiled.data_fields),
            "options": {
                "source": source,
                **self._tokenizer_options(),
                **opts,
                "samples_per_prompt": samples,
            },
        }

    def to_yaml(self, path: str | Path | None = None, **topology: Any) -> str:
        """The equivalent topology file (for `hybridflow run`); written to `path` if
        given. The logic is kept as a comment on top (the ops below are what it means)."""
        import yaml

        topo = self.topology(**topology)
        assert self._step is not None
        header = [
            f"# hybridflow topology written by DataflowBuilder.to_yaml ({self.name})",
            f"# training step: inputs {list(self._step[0])}, outputs {list(self._step[1])}",
            "# logic (compiled into `dataflow` below):",
        ]
        header += [f"#   {line}" for line in self._step[2].strip("\n").splitlines()]
        text = "\n".join(header) + "\n" + yaml.safe_dump(to_dict(topo), sort_keys=False)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        return text

    def build(
        self,
        log_level: str = "WARNING",
        metrics_backend: str | Sequence[str] | None = "jsonl",
        log_dir: str | Path | None = None,
        device_mapping: Mapping[str, Any] | None = None,
        *,
        resume_from: str | Path | None = None,
        launcher: Any = None,
    ) -> Engine:
        """Compile, place and check everything; -> an Engine. Raises ConfigError (or its
        CompileError) for anything impossible: bad logic, devices, options, data."""
        from hybridflow.pipeline.topology import build_plan

        log_dir = Path(log_dir or Path("runs") / self.name)
        settings = {
            "log_dir": log_dir,
            "metrics_backend": metrics_backend,
            "log_level": log_level,
            "device_mapping": dict(device_mapping or {}),
            "multi_host": launcher is not None,
        }
        topo = self.topology(**settings)
        _check_models(topo)
        build_plan(topo, check_devices=True)  # registries, data source, driver ops, devices
        logging.getLogger("hybridflow").setLevel(log_level)
        engine = Engine(self, settings, launcher)
        if resume_from is not None:
            engine.resume(resume_from)
        return engine


# ---------------------------------------------------------------------------------------


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
            (Path(save_path) / "latest").write_text(dst.name + "\n")
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
        chosen = dataset if dataset is not None else self.builder._data.get("dataset", "last_digit")
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
                    "source": _dataset_source(chosen, self.log_dir),
                    **self.builder._tokenizer_options(),
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
        self._use_policy(str(policy))
        self.step, self.state = 0, None
        return self._result(res, topo)

    def _use_policy(self, model_dir: str) -> None:
        """Every role built from the actor's model now starts from `model_dir`."""
        roles = self.builder._roles
        old = roles["actor"].options["model"]
        for spec in roles.values():
            if spec.options.get("model") == old:
                spec.options["model"] = model_dir
                spec.options.pop("model_overrides", None)  # the directory's config has them

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
        keep = [op for op in raw["dataflow"] if op["role"] in ("rollout", "reward")]
        for op in keep:
            op["inputs"] = [i for i in op["inputs"] if i != "group_index"]
        raw["dataflow"] = keep
        raw["metrics"] = {"backends": ["null"]}
        raw["run_dir"] = str(self.log_dir / "generate")
        topo = load_topology(raw)
        collect = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rewards")
        res = self._run(topo, self.step, None, collect=collect)
        got = {k: _cat(v) for k, v in res.collected[self.step].items()}
        opts = self.builder._tokenizer_options()
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
        step = self.builder._step
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
        from hybridflow.pipeline.runner import run_topology

        resume_dir = self.state if resume else None
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
        assert self.builder._step is not None
        compiled = self.builder.compile()
        for name, metric in compiled.outputs.items():
            if metric:
                outputs[name] = [row.get(metric, math.nan) for row in rows]
        return TrainResult(
            rows, outputs, res.checkpoints[-1] if res.checkpoints else "", str(topo.run_dir)
        )


# ---------------------------------------------------------------------------------------


def _role_mapping(value: Any, role: str, keys: tuple[str, ...]) -> Any:
    """`device_mapping` as given to add_*: a mapping value, or a dict keyed by role."""
    if isinstance(value, Mapping):
        bad = [k for k in value if k not in keys]
        if bad:
            raise ConfigError(
                f"device_mapping.{bad[0]}",
                f"not a role of this call; use {' or '.join(map(repr, keys))}"
                + (
                    " (the rollout always shares the actor's devices)"
                    if bad[0] == "rollout"
                    else ""
                ),
            )
        if "rollout" in value and value.get("rollout") != value.get("actor", value["rollout"]):
            raise ConfigError(
                "device_mapping.rollout",
                "the rollout always shares the actor's devices (hybrid engine); map the actor",
            )
        found = [value[k] for k in keys if k in value]
        return found[0] if found else None
    return value


def _backends(value: str | Sequence[str] | None) -> list[str]:
    if value is None or value == "none":
        return ["null"]
    return [value] if isinstance(value, str) else list(value)


def _dataset_source(dataset: Any, log_dir: Path | None) -> str:
    """A dataset argument -> the data source's `source` option."""
    from hybridflow.data.tasks import TASKS

    if isinstance(dataset, Path):
        dataset = str(dataset)
    if isinstance(dataset, str):
        if dataset in TASKS:
            return f"task:{dataset}"
        return dataset  # task:NAME, a file or a directory: the source checks it
    if isinstance(dataset, Sequence) and dataset:
        records = [{"prompt": d} if isinstance(d, str) else dict(d) for d in dataset]
        base = log_dir or Path("runs")
        base.mkdir(parents=True, exist_ok=True)
        blob = json.dumps(records, sort_keys=True)
        import hashlib

        path = base / f"prompts-{hashlib.sha256(blob.encode()).hexdigest()[:10]}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return str(path)
    raise ConfigError(
        "dataset", f"expected a task name, a path or a list of prompts, got {dataset!r}"
    )


def _layout(stages: Mapping[str, Any]) -> dict[str, Any]:
    """stage -> (replicas, sorted roles): what a checkpoint's parts are keyed by."""
    return {
        name: (int(cfg.get("replicas", 1)), sorted(cfg.get("roles", {})))
        for name, cfg in stages.items()
    }


def _check_models(topo: Topology) -> None:
    """Every model a role names exists (a directory or a preset): fail before launch."""
    from hybridflow.models.loader import resolve_model

    for stage, cfg in topo.stages.items():
        for role, rc in cfg.roles.items():
            model = rc.options.get("model")
            if isinstance(model, str) and rc.backend in ("hf", "model", "vllm"):
                resolve_model(model, f"stages.{stage}.roles.{role}.options.model")


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install counts as no GPU
        return 0


def _cat(parts: list[Any]) -> Any:
    from hybridflow.pipeline.scheduler import concat_rows

    return concat_rows(list(parts))

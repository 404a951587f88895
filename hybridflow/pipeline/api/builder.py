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
the logic (pipeline/compiler/), places roles on processes (pipeline/api/placement.py) and
checks the result as a Topology, so every mistake surfaces there, before any process
starts. `to_yaml()` writes that Topology: `hybridflow run FILE` runs the same plan.

The Engine (pipeline/engine.py) runs each call (`train`, `sft`, `run`) as one pipeline
run and keeps its state between calls in checkpoints: `save_checkpoint(save_path,
save_interval, keep_last)` chooses where and how often, `resume_from="latest"` or a
path continues an earlier job, even from another process.

Invariants: the builder never imports torch (build() does, to count GPUs); nothing the
user wrote is executed (the logic is parsed, reward functions are imported by name in
their stage process); one seed drives every stage.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.config.imports import split_spec
from hybridflow.config.loader import to_dict
from hybridflow.config.schema import LOG_LEVELS, Topology, load_topology
from hybridflow.config.stages import ROLE_NAMES, role_kind
from hybridflow.errors import ConfigError
from hybridflow.pipeline.api.placement import normalize, place
from hybridflow.pipeline.compiler.frontend import CompiledStep, compile_step
from hybridflow.pipeline.sources.datasets import dataset_source

if TYPE_CHECKING:
    from hybridflow.pipeline.api.engine import Engine, TrainResult  # noqa: F401

log = logging.getLogger("hybridflow.pipeline.api.builder")

# `metrics_backend`: a sink name, a list of them, or the `metrics:` section (_metrics_section).
MetricsBackend = str | Sequence[str] | Mapping[str, Any] | None

# Options of the actor that belong to the rollout engine (sampling) instead.
_ROLLOUT_KEYS = ("max_new_tokens", "top_p", "top_k", "max_batch_size", "stop_on_eos")
# Model options every role built from the actor's model shares.
_ROLLOUT_BACKENDS = ("hf", "native", "vllm")
_MODEL_KEYS = ("tokenizer", "dtype", "init_seed", "init_device", "autocast_bf16", "model_overrides")
_LIVENESS = {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 30.0, "startup_timeout_s": 180.0}
_RUN_KEYS = ("step_batch", "micro_batch", "max_offpolicy_steps", "mode", "max_inflight")
_TIMING = ("timing/", "compute/", "perf/", "checkpoint/", "rollout/gen_s", "rollout/tokens_per_s")


@dataclass
class _Role:
    backend: str
    options: dict[str, Any]
    mapping: Any  # as the user wrote it; None: the default for the role


class DataflowBuilder:
    """Declarations of one RL job (see the module docstring)."""

    def __init__(self, name: str = "hybridflow", *, seed: int = 0) -> None:
        self.name, self.seed = name, seed
        self._roles: dict[str, _Role] = {}
        self._step: tuple[tuple[str, ...], tuple[str, ...], str] | None = None
        self._compiled: tuple[Any, CompiledStep] | None = None  # (key, step): see compile()
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
        rollout_backend: str | None = None,
        **options: Any,
    ) -> DataflowBuilder:
        """The policy: its training weights (`actor`) and its sampler (`rollout`). The
        sampler's engine is `rollout_backend`: "hf" (transformers, the default), "native"
        (the project's own GPU engine) or "vllm" (`use_vllm=True` says the same). By
        default they share the actor's devices (the hybrid engine: reshard in
        process); `device_mapping={"actor": ..., "rollout": ...}` with disjoint devices
        puts the sampler in its own process (weights stream stage to stage after each
        optimizer step). `options` are the actor's (lr, grad_clip, ppo_epochs, ...);
        sampling keys (max_new_tokens, top_p, top_k, temperature) go to the rollout,
        `temperature` to both; `rollout` holds the engine's own options (kv_cache_gb,
        dtype, ...)."""
        if rollout_backend is None:
            rollout_backend = "vllm" if use_vllm else "hf"
        elif use_vllm and rollout_backend != "vllm":
            raise ConfigError(
                "add_actor.rollout_backend",
                f"{rollout_backend!r} contradicts use_vllm=True; give one of them",
            )
        if rollout_backend not in _ROLLOUT_BACKENDS:
            raise ConfigError(
                "add_actor.rollout_backend",
                f"unknown engine {rollout_backend!r}; known: {', '.join(_ROLLOUT_BACKENDS)}",
            )
        mapping = _role_mapping(device_mapping, "actor", "rollout")
        roll_map = device_mapping.get("rollout") if isinstance(device_mapping, Mapping) else None
        if roll_map is not None:
            normalize("rollout", roll_map)
        actor = {k: v for k, v in options.items() if k not in _ROLLOUT_KEYS}
        roll = {k: v for k, v in options.items() if k in _ROLLOUT_KEYS or k in _MODEL_KEYS}
        if "temperature" in options:
            roll["temperature"] = options["temperature"]
        roll.update(rollout or {})
        self._add("actor", "hf", {"model": model_name, **actor}, mapping)
        self._roles["rollout"] = _Role(rollout_backend, {"model": model_name, **roll}, roll_map)
        return self

    def add_environment(
        self,
        env: str,
        env_options: Mapping[str, Any] | None = None,
        *,
        reward: bool = True,
        max_turns: int | None = None,
        max_total_tokens: int | None = None,
    ) -> DataflowBuilder:
        """Multi-turn rollouts: the sampler plays each prompt in `env` (a built-in name such
        as "calculator", or `package.module:Class`, built with `env_options`), turn after
        turn, in the rollout's process (stages/rollout/multiturn.py); `max_turns` and
        `max_total_tokens` bound the trajectory loop. `reward=True`: the environment's
        reward is the run's reward (the `env` reward backend, in the rollout's stage),
        and `reward.score` in the logic scores with it; False: add a reward of your own.
        Other loop options (env_timeout_s, env_concurrency, tool_parser) go in
        `add_actor(rollout=...)`. With an `env` in the rollout's options (from here or
        from `add_actor(rollout={"env": ...})`), the compiled dataflow feeds `generate`
        each row's record (metadata_json) and takes env_reward and num_turns from it."""
        roll = self._roles.get("rollout")
        if roll is None:
            raise ConfigError("add_environment", "add the actor first (df.add_actor)")
        if not isinstance(env, str) or not env or ":" in env:  # a name is checked at build()
            split_spec(env, "add_environment.env", form="a built-in name or package.module:Class")
        if roll.options.get("env"):
            raise ConfigError(
                "add_environment", f"the rollout already has env {roll.options['env']!r}"
            )
        loop = {"max_turns": max_turns, "max_total_tokens": max_total_tokens}
        roll.options.update(env=env, env_options=dict(env_options or {}))
        roll.options.update({k: v for k, v in loop.items() if v is not None})
        if reward:  # colocated with the rollout (see _stages): it holds no model
            self._add("reward", "env", {}, None)
        return self

    def add_critic(
        self, model_name: str, device_mapping: Any = None, **options: Any
    ) -> DataflowBuilder:
        """A value model (a value head on `model_name`'s trunk) for GAE."""
        mapping = _role_mapping(device_mapping, "critic")
        return self._add("critic", "hf", {"model": model_name, **options}, mapping)

    def add_reference_model(
        self, model_name: str, device_mapping: Any = None, **options: Any
    ) -> DataflowBuilder:
        """The frozen initial policy (`ref` in the logic), for the KL term."""
        mapping = _role_mapping(device_mapping, "reference")
        return self._add("reference", "hf", {"model": model_name, **options}, mapping)

    def add_reward_model(
        self, model_name: str, device_mapping: Any = None, **options: Any
    ) -> DataflowBuilder:
        """A sequence-classification reward model (`reward` in the logic)."""
        mapping = _role_mapping(device_mapping, "reward")
        return self._add("reward", "model", {"model": model_name, **options}, mapping)

    def add_reward_function(
        self, function: str, device_mapping: Any = None, **options: Any
    ) -> DataflowBuilder:
        """A Python reward function `package.module:function` (batched signature, see
        hybridflow.stages.reward.function); imported by name in its stage process."""
        # Syntax only: the function is imported in its stage process.
        split_spec(function, "add_reward_function", form="package.module:function")
        mapping = _role_mapping(device_mapping, "reward")
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
        mapping = _role_mapping(device_mapping, "reward")
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
        """The step as Python-like logic (compiled, never executed: pipeline/compiler/).
        `outputs` is a contract: `Engine.run` returns exactly these names and `train`
        reports them per step; a name the step never computes is a CompileError naming
        it, raised here."""
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
        """The compiled step, compiled once per (logic, declared roles): the result is
        immutable and depends on nothing else, so define_training_step, topology() and
        every Engine call share one compile."""
        if self._step is None:
            raise ConfigError("define_training_step", "no training step defined yet")
        inputs, outputs, logic = self._step
        key = (self._step, frozenset(self._roles))
        if self._compiled is None or self._compiled[0] != key:
            self._compiled = (key, compile_step(logic, inputs, outputs, self._roles))
        return self._compiled[1]

    # -- build ----------------------------------------------------------------------------
    def topology(
        self,
        *,
        dataset: Any = None,
        steps: int = 1,
        log_dir: str | Path | None = None,
        metrics_backend: MetricsBackend = "jsonl",
        log_level: str = "WARNING",
        device_mapping: Mapping[str, Any] | None = None,
        cuda_count: int | None = None,
        multi_host: bool = False,
        transport: Mapping[str, Any] | None = None,
    ) -> Topology:
        """The Topology these declarations stand for (validated). `transport`: its
        `transport:` section (a multi-host launcher's), else the defaults."""
        if "actor" not in self._roles:
            raise ConfigError("add_actor", "a job needs an actor (df.add_actor)")
        compiled = self.compile()
        stages = self._stages(compiled, device_mapping or {}, cuda_count, multi_host)
        data = self._data_config(compiled, dataset, log_dir)
        metrics = _metrics_section(metrics_backend)
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
            "dataflow": self._with_environment(_with_weight_sync(compiled, stages)),
            "liveness": dict(_LIVENESS),
            "metrics": metrics,
            "log_level": log_level,
            "run_dir": str(log_dir) if log_dir else "",
        }
        if transport:
            raw["transport"] = dict(transport)
        return load_topology(raw)

    def _stages(
        self,
        compiled: CompiledStep,
        overrides: Mapping[str, Any],
        cuda_count: int | None,
        multi_host: bool,
    ) -> dict[str, Any]:
        """-> the Topology's `stages` (with `hosts` where the mappings name other hosts)."""
        options = self._role_options(compiled)
        gpu = _cuda_count() if cuda_count is None else cuda_count
        default = "cuda:0" if gpu else "cpu"
        actor_map = self._roles["actor"].mapping or default
        mappings: dict[str, Any] = {}
        for role, spec in self._roles.items():
            mapping = spec.mapping
            if role in ("actor", "rollout"):  # the hybrid engine unless mapped apart
                mappings[role] = actor_map if mapping is None else mapping
                continue
            if mapping is None and spec.backend == "env":  # beside the rollout it reads
                mapping = mappings["rollout"]
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
            runtime = role_kind(role)
            if runtime not in mappings:
                raise ConfigError(
                    f"device_mapping.{role}", f"no such role here; roles: {', '.join(mappings)}"
                )
            mappings[runtime] = mapping
            if runtime == "actor" and "rollout" not in overrides and spec_map_is_default(self):
                mappings["rollout"] = mapping  # the rollout follows the actor
        slots = {role: normalize(role, m) for role, m in mappings.items()}
        stages = {}
        for sp in place(slots, cuda_count=gpu, multi_host=multi_host):
            name = "engine" if {"actor", "rollout"} <= set(sp.roles) else sp.name
            stages[name] = {
                "replicas": sp.replicas,
                "devices": sp.devices,
                "roles": {
                    r: {"backend": self._roles[r].backend, "options": options[r]} for r in sp.roles
                },
            }
            if any(s.node for s in sp.slots):  # the launcher reads them from the plan
                stages[name]["hosts"] = [s.node for s in sp.slots]
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

    def _with_environment(self, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """With an environment (add_environment): `generate` reads each row's record and
        makes env_reward and num_turns; an `env` reward scores env_reward."""
        if not self._roles["rollout"].options.get("env"):
            return ops
        env_reward = "reward" in self._roles and self._roles["reward"].backend == "env"
        for op in ops:
            if op["role"] == "rollout" and op["op"] == "generate":
                op["inputs"] = [*op["inputs"], "metadata_json"]
                op["outputs"] = [*op["outputs"], "env_reward", "num_turns"]
            elif env_reward and op["role"] == "reward" and op["op"] == "score":
                op["inputs"] = ["env_reward"]
        return ops

    @property
    def step_spec(self) -> tuple[tuple[str, ...], tuple[str, ...], str] | None:
        """(inputs, outputs, logic) of define_training_step, or None."""
        return self._step

    @property
    def dataset(self) -> Any:
        """The default dataset (set_data), else the built-in `last_digit` task."""
        return self._data.get("dataset", "last_digit")

    def use_policy(self, model_dir: str) -> None:
        """Every role built from the actor's model starts from `model_dir` from now on
        (after SFT: the fine-tuned policy replaces the initial one everywhere)."""
        old = self._roles["actor"].options["model"]
        for spec in self._roles.values():
            if spec.options.get("model") == old:
                spec.options["model"] = model_dir
                spec.options.pop("model_overrides", None)  # the directory's config has them

    def actor_options(self) -> dict[str, Any]:
        """The actor's declared options (a copy)."""
        return dict(self._roles["actor"].options)

    def tokenizer_options(self) -> dict[str, Any]:
        return self._tokenizer_options()

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
        source = dataset_source(chosen, Path(log_dir) if log_dir else None)
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
        metrics_backend: MetricsBackend = "jsonl",
        log_dir: str | Path | None = None,
        device_mapping: Mapping[str, Any] | None = None,
        *,
        resume_from: str | Path | None = None,
        launcher: Any = None,
    ) -> Engine:
        """Compile, place and check everything; -> an Engine. Raises ConfigError (or its
        CompileError) for anything impossible: bad logic, devices, options, data.
        `launcher`: None (processes on this host), "ray" (a RayLauncher on the cluster
        of RAY_ADDRESS, else a local one: node names in `device_mapping` are Ray hosts)
        or a Launcher object."""
        from hybridflow.pipeline.plan.planner import build_plan

        if launcher == "ray":
            from hybridflow.pipeline.runtime.ray_launcher import RayLauncher

            launcher = RayLauncher()
        log_dir = Path(log_dir or Path("runs") / self.name)
        settings = {
            "log_dir": log_dir,
            "metrics_backend": metrics_backend,
            "log_level": log_level,
            "device_mapping": dict(device_mapping or {}),
            # A launcher that places processes on hosts says so with `assign_nodes`.
            "multi_host": callable(getattr(launcher, "assign_nodes", None)),
        }
        if callable(getattr(launcher, "transport_settings", None)):
            settings["transport"] = launcher.transport_settings()  # e.g. TCP off loopback
        topo = self.topology(**settings)
        _check_models(topo)
        # registries, data source, driver ops; local GPUs unless processes go elsewhere
        build_plan(topo, check_devices=not settings["multi_host"])
        logging.getLogger("hybridflow").setLevel(log_level)
        from hybridflow.pipeline.api.engine import Engine

        engine = Engine(self, settings, launcher)
        if resume_from is not None:
            engine.resume(resume_from)
        return engine


# ---------------------------------------------------------------------------------------


def _role_mapping(value: Any, role: str, *others: str) -> Any:
    """`device_mapping` as given to add_*: a mapping value, or a dict keyed by any name of
    `role` (config's ROLE_NAMES: `ref` or `reference`); `others`: roles this call also
    places, whose keys the caller reads."""
    keys = ROLE_NAMES[role] + tuple(n for other in others for n in ROLE_NAMES[other])
    own = ROLE_NAMES[role]
    if isinstance(value, Mapping):
        bad = [k for k in value if k not in keys]
        if bad:
            raise ConfigError(
                f"device_mapping.{bad[0]}",
                f"not a role of this call; use {' or '.join(map(repr, keys))}",
            )
        found = [value[k] for k in own if k in value]
        return found[0] if found else None
    return value


def spec_map_is_default(builder: DataflowBuilder) -> bool:
    """The rollout was given no mapping of its own (it follows the actor's)."""
    return builder._roles["rollout"].mapping is None


def _with_weight_sync(compiled: CompiledStep, stages: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The dataflow, plus `rollout.load_weights` after `actor.reshard` when the rollout
    lives in another stage (pipeline/host/weight_sync.py streams the weights between them)."""
    ops = [to_dict(op) for op in compiled.dataflow]
    where = {role: name for name, cfg in stages.items() for role in cfg["roles"]}
    apart = where.get("rollout") != where.get("actor")
    if apart and any(op["role"] == "actor" and op["op"] == "reshard" for op in ops):
        ops.append({"role": "rollout", "op": "load_weights", "scope": "step", "phase": "reshard"})
    return ops


def _metrics_section(value: MetricsBackend) -> dict[str, Any]:
    """`metrics_backend` as the topology's `metrics:` section: one sink name, a list of
    them (`["jsonl", "wandb", "mlflow"]`), or the section itself
    (`{"backends": [...], "options": {"project": ..., "run_name": ..., "tags": [...]}}`);
    None or "none" logs nothing. The topology's loader checks names and keys."""
    if value is None or value == "none":
        return {"backends": ["null"]}
    if isinstance(value, str):
        return {"backends": [value]}
    if isinstance(value, Mapping):
        return dict(value)
    return {"backends": list(value)}


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


def __getattr__(name: str) -> Any:  # PEP 562: the Engine lives in hybridflow.pipeline.api.engine
    if name in ("Engine", "TrainResult"):
        from hybridflow.pipeline.api import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'hybridflow.pipeline.api.builder' has no attribute {name!r}")

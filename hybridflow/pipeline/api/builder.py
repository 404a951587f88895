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

`build()` freezes the declarations (pipeline/api/declared.py) and hands the Engine
(pipeline/api/engine.py) a `Job` of plain data (pipeline/api/job.py): changing the
builder afterwards changes no engine. The Engine runs each call (`train`, `sft`, `run`)
as one pipeline run and keeps its state between calls in checkpoints:
`save_checkpoint(save_path, save_interval, keep_last)` chooses where and how often,
`resume_from="latest"` or a path continues an earlier job, even from another process.

Invariants: the builder never imports torch (build() does, to count GPUs); nothing the
user wrote is executed (the logic is parsed, reward functions are imported by name in
their stage process); one seed drives every stage.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.config.imports import split_spec
from hybridflow.config.loader import to_dict
from hybridflow.config.schema import Topology
from hybridflow.config.stages import ROLE_NAMES
from hybridflow.errors import ConfigError
from hybridflow.pipeline.api.declared import (
    DEFAULT_DATASET,
    MODEL_KEYS,
    Declared,
    MetricsBackend,
    RoleDecl,
    training_topology,
)

# tests/pipeline/test_pipeline_trackers.py reads the metrics section from here
from hybridflow.pipeline.api.declared import metrics_section as _metrics_section  # noqa: F401
from hybridflow.pipeline.api.placement import normalize
from hybridflow.pipeline.compiler.frontend import CompiledStep, compile_step

if TYPE_CHECKING:
    from hybridflow.pipeline.api.engine import Engine, TrainResult  # noqa: F401

# Options of the actor that belong to the rollout engine (sampling) instead.
_ROLLOUT_KEYS = ("max_new_tokens", "top_p", "top_k", "max_batch_size", "stop_on_eos")
_ROLLOUT_BACKENDS = ("hf", "native", "vllm")
_RUN_KEYS = ("step_batch", "micro_batch", "max_offpolicy_steps", "mode", "max_inflight")


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
        roll = {k: v for k, v in options.items() if k in _ROLLOUT_KEYS or k in MODEL_KEYS}
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
    def topology(self, **settings: Any) -> Topology:
        """The Topology these declarations stand for (validated). The keyword settings
        are pipeline/api/declared.py `training_topology`'s, forwarded (and shown as this
        method's signature); `transport` is the `transport:` section (a multi-host
        launcher's), else the defaults."""
        if "actor" not in self._roles:
            raise ConfigError("add_actor", "a job needs an actor (df.add_actor)")
        return training_topology(self.declared(), self.compile(), **settings)

    def declared(self) -> Declared:
        """The declarations as they are now, frozen (a copy: later calls change none)."""
        if self._step is None:
            raise ConfigError("define_training_step", "no training step defined yet")
        roles = {
            name: RoleDecl(spec.backend, copy.deepcopy(spec.options), copy.deepcopy(spec.mapping))
            for name, spec in self._roles.items()
        }
        return Declared(self.name, self.seed, roles, self._step, dict(self._run), dict(self._data))

    @property
    def step_spec(self) -> tuple[tuple[str, ...], tuple[str, ...], str] | None:
        """(inputs, outputs, logic) of define_training_step, or None."""
        return self._step

    @property
    def dataset(self) -> Any:
        """The default dataset (set_data), else the built-in `last_digit` task."""
        return self._data.get("dataset", DEFAULT_DATASET)

    def actor_options(self) -> dict[str, Any]:
        """The actor's declared options (a copy)."""
        return dict(self._roles["actor"].options)

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
        from hybridflow.pipeline.api.job import Job
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
        if "actor" not in self._roles:
            raise ConfigError("add_actor", "a job needs an actor (df.add_actor)")
        job = Job.make(self.declared(), self.compile(), settings)
        _check_models(job.topology)
        # registries, data source, driver ops; local GPUs unless processes go elsewhere
        build_plan(job.topology, check_devices=not settings["multi_host"])
        logging.getLogger("hybridflow").setLevel(log_level)
        from hybridflow.pipeline.api.engine import Engine

        engine = Engine(job, launcher)
        if resume_from is not None:
            engine.resume(resume_from)
        return engine


# The settings are written once, as training_topology's keywords; `inspect` (help(), the
# API reference) shows them on the method that forwards them.
def _keywords_of(fn: Any) -> inspect.Signature:
    """`fn`'s keyword-only parameters as a method's signature (self, then them)."""
    sig = inspect.signature(fn)
    keywords = [p for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY]
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sig.replace(parameters=[this, *keywords])


DataflowBuilder.topology.__signature__ = _keywords_of(training_topology)  # type: ignore[attr-defined]


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


def _check_models(topo: Topology) -> None:
    """Every model a role names exists (a directory or a preset): fail before launch."""
    from hybridflow.models.loader import resolve_model

    for stage, cfg in topo.stages.items():
        for role, rc in cfg.roles.items():
            model = rc.options.get("model")
            if isinstance(model, str) and rc.backend in ("hf", "model", "vllm"):
                resolve_model(model, f"stages.{stage}.roles.{role}.options.model")


def __getattr__(name: str) -> Any:  # PEP 562: the Engine lives in hybridflow.pipeline.api.engine
    if name in ("Engine", "TrainResult"):
        from hybridflow.pipeline.api import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'hybridflow.pipeline.api.builder' has no attribute {name!r}")

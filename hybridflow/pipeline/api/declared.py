"""What a DataflowBuilder declared, as plain frozen data, and the training Topology it
stands for.

    DataflowBuilder (mutable, add_* / configure / set_data)  --snapshot-->  Declared
    Declared + CompiledStep + settings  --training_topology-->  Topology (validated)

`Declared` holds the declarations only (roles with their backend, options and device
mapping as written, the step logic, run sizes, data options); nothing here refers back
to the builder, so the Engine runs a snapshot (pipeline/api/job.py) and a builder changed
after `build()` changes no engine. The topology is assembled here: roles placed on
processes (placement.py), options each role shares with the actor's model, what the
compiled logic implies for each role, the environment's inputs, the weight sync between
a rollout and an actor that live apart, and the data source reading the default dataset.

Invariants: a Declared is never mutated (`with_policy` returns a new one); the same
Declared, compiled step and settings always give the same Topology; every mistake is a
ConfigError raised here, before any process starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.config.fields import METADATA
from hybridflow.config.loader import to_dict
from hybridflow.config.schema import LOG_LEVELS, Topology, load_topology
from hybridflow.config.stages import role_kind
from hybridflow.errors import ConfigError
from hybridflow.pipeline.api.placement import normalize, place
from hybridflow.pipeline.compiler.ir import CompiledStep
from hybridflow.pipeline.sources.datasets import dataset_source

# `metrics_backend`: a sink name, a list of them, or the `metrics:` section (metrics_section).
MetricsBackend = str | Sequence[str] | Mapping[str, Any] | None

# Model options every role built from the actor's model shares.
MODEL_KEYS = ("tokenizer", "dtype", "init_seed", "init_device", "autocast_bf16", "model_overrides")
_LIVENESS = {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 30.0, "startup_timeout_s": 180.0}
DEFAULT_DATASET = "last_digit"


@dataclass(frozen=True)
class RoleDecl:
    """One declared role: its backend, its options as given, its device mapping as the
    user wrote it (None: the default for the role)."""

    backend: str
    options: Mapping[str, Any]
    mapping: Any = None


@dataclass(frozen=True)
class Declared:
    """A DataflowBuilder's declarations, frozen (see the module docstring)."""

    name: str
    seed: int
    roles: Mapping[str, RoleDecl]
    step: tuple[tuple[str, ...], tuple[str, ...], str]  # (inputs, outputs, logic)
    run: Mapping[str, Any]  # configure(...)'s run sizes
    data: Mapping[str, Any]  # set_data(...)'s dataset and prompt options

    @property
    def dataset(self) -> Any:
        """The default dataset (set_data), else the built-in `last_digit` task."""
        return self.data.get("dataset", DEFAULT_DATASET)

    @property
    def actor_options(self) -> dict[str, Any]:
        """The actor's declared options (a copy)."""
        return dict(self.roles["actor"].options)

    def tokenizer_options(self) -> dict[str, Any]:
        """Where the actor's tokenizer comes from, for roles that only decode text."""
        actor = self.roles["actor"].options
        if actor.get("tokenizer"):
            return {"tokenizer": actor["tokenizer"]}
        if not Path(str(actor["model"])).is_dir():
            return {"tokenizer": "builtin"}  # presets use the built-in tokenizer
        return {"model": actor["model"]}

    def with_policy(self, model_dir: str) -> Declared:
        """Every role built from the actor's model starts from `model_dir` (after SFT: the
        fine-tuned policy replaces the initial one everywhere)."""
        old = self.roles["actor"].options["model"]
        roles = {}
        for name, spec in self.roles.items():
            if spec.options.get("model") == old:
                options = {k: v for k, v in spec.options.items() if k != "model_overrides"}
                spec = dataclasses.replace(spec, options={**options, "model": model_dir})
            roles[name] = spec  # model_overrides: the directory's config has them
        return dataclasses.replace(self, roles=roles)


def training_topology(
    declared: Declared,
    compiled: CompiledStep,
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
    """The Topology `declared` stands for (validated). `transport`: its `transport:`
    section (a multi-host launcher's), else the defaults."""
    if "actor" not in declared.roles:
        raise ConfigError("add_actor", "a job needs an actor (df.add_actor)")
    stages = _stages(declared, compiled, device_mapping or {}, cuda_count, multi_host)
    if log_level not in LOG_LEVELS:
        raise ConfigError("log_level", f"must be one of {', '.join(LOG_LEVELS)}; got {log_level!r}")
    raw = {
        "name": declared.name,
        "seed": declared.seed,
        "run": {"steps": steps, **declared.run},
        "data": _data_config(declared, compiled, dataset, log_dir),
        "stages": stages,
        "dataflow": _with_environment(declared, _with_weight_sync(compiled, stages)),
        "liveness": dict(_LIVENESS),
        "metrics": metrics_section(metrics_backend),
        "log_level": log_level,
        "run_dir": str(log_dir) if log_dir else "",
    }
    if transport:
        raw["transport"] = dict(transport)
    return load_topology(raw)


def _mappings(declared: Declared, overrides: Mapping[str, Any], gpu: int) -> dict[str, Any]:
    """Each role's device mapping: as declared, else its default, then `overrides`."""
    roles = declared.roles
    actor_map = roles["actor"].mapping or ("cuda:0" if gpu else "cpu")
    mappings: dict[str, Any] = {}
    for role, spec in roles.items():
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
    follows = roles["rollout"].mapping is None  # no mapping of its own: it follows the actor
    for role, mapping in overrides.items():
        runtime = role_kind(role)
        if runtime not in mappings:
            raise ConfigError(
                f"device_mapping.{role}", f"no such role here; roles: {', '.join(mappings)}"
            )
        mappings[runtime] = mapping
        if runtime == "actor" and "rollout" not in overrides and follows:
            mappings["rollout"] = mapping
    return mappings


def _stages(
    declared: Declared,
    compiled: CompiledStep,
    overrides: Mapping[str, Any],
    cuda_count: int | None,
    multi_host: bool,
) -> dict[str, Any]:
    """-> the Topology's `stages` (with `hosts` where the mappings name other hosts)."""
    options = _role_options(declared, compiled)
    gpu = _cuda_count() if cuda_count is None else cuda_count
    mappings = _mappings(declared, overrides, gpu)
    slots = {role: normalize(role, m) for role, m in mappings.items()}
    stages = {}
    for sp in place(slots, cuda_count=gpu, multi_host=multi_host):
        name = "engine" if {"actor", "rollout"} <= set(sp.roles) else sp.name
        stages[name] = {
            "replicas": sp.replicas,
            "devices": sp.devices,
            "roles": {
                r: {"backend": declared.roles[r].backend, "options": options[r]} for r in sp.roles
            },
        }
        if any(s.node for s in sp.slots):  # the launcher reads them from the plan
            stages[name]["hosts"] = [s.node for s in sp.slots]
    return stages


def _role_options(declared: Declared, compiled: CompiledStep) -> dict[str, dict[str, Any]]:
    """Each role's options: as declared, plus what it shares with the actor's model, the
    tokenizer a text-reading reward needs, and what the compiled logic implies."""
    roles = declared.roles
    out = {role: dict(spec.options) for role, spec in roles.items()}
    actor = out["actor"]
    shared = {k: actor[k] for k in MODEL_KEYS if k in actor}
    if "temperature" in actor:
        shared["temperature"] = actor["temperature"]
    for role in ("rollout", "reference"):
        if role in out and out[role].get("model") == actor["model"]:
            out[role] = {**shared, **out[role]}
    reward = out.get("reward")
    if reward is not None and "tokenizer" not in reward and "model" not in reward:
        backend = roles["reward"].backend
        if backend == "function":  # decodes text with the actor's tokenizer
            reward.update(declared.tokenizer_options())
        elif backend in ("http", "zmq"):  # services get text too
            model = str(actor["model"])
            reward["tokenizer"] = actor.get("tokenizer") or (
                model if Path(model).is_dir() else "builtin"
            )
    # The sampler's log-probs stand for the actor's: one temperature for the policy.
    temp = compiled.role_options.get("rollout", {}).get("temperature")
    if temp:
        for role in ("actor", "reference"):
            if role in out and "temperature" not in roles[role].options:
                out[role]["temperature"] = temp
    for role, implied in compiled.role_options.items():
        if role == "data":
            continue
        target = out.setdefault(role, {})
        for key, value in implied.items():
            given = roles[role].options.get(key) if role in roles else None
            if given is not None and given != value:
                raise ConfigError(
                    f"{role}.{key}",
                    f"{given!r} conflicts with the training step's logic, which implies "
                    f"{value!r}; set it in one place",
                )
            target[key] = value
    return out


def _with_environment(declared: Declared, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """With an environment (add_environment): `generate` reads each row's record and
    makes env_reward and num_turns; an `env` reward scores env_reward."""
    roles = declared.roles
    if not roles["rollout"].options.get("env"):
        return ops
    env_reward = "reward" in roles and roles["reward"].backend == "env"
    for op in ops:
        if op["role"] == "rollout" and op["op"] == "generate":
            op["inputs"] = [*op["inputs"], METADATA]
            op["outputs"] = [*op["outputs"], "env_reward", "num_turns"]
        elif env_reward and op["role"] == "reward" and op["op"] == "score":
            op["inputs"] = ["env_reward"]
    return ops


def _data_config(
    declared: Declared, compiled: CompiledStep, dataset: Any, log_dir: str | Path | None
) -> dict[str, Any]:
    opts = {k: v for k, v in declared.data.items() if k != "dataset"}
    chosen = dataset if dataset is not None else declared.dataset
    source = dataset_source(chosen, Path(log_dir) if log_dir else None)
    return {
        "source": "prompts",
        "fields": list(compiled.data_fields),
        "options": {
            "source": source,
            **declared.tokenizer_options(),
            **opts,
            "samples_per_prompt": compiled.samples_per_prompt,
        },
    }


def _with_weight_sync(compiled: CompiledStep, stages: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The dataflow, plus `rollout.load_weights` after `actor.reshard` when the rollout
    lives in another stage (pipeline/host/weight_sync.py streams the weights between them)."""
    ops = [to_dict(op) for op in compiled.dataflow]
    where = {role: name for name, cfg in stages.items() for role in cfg["roles"]}
    apart = where.get("rollout") != where.get("actor")
    if apart and any(op["role"] == "actor" and op["op"] == "reshard" for op in ops):
        ops.append({"role": "rollout", "op": "load_weights", "scope": "step", "phase": "reshard"})
    return ops


def metrics_section(value: MetricsBackend) -> dict[str, Any]:
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


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install counts as no GPU
        return 0

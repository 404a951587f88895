"""The topology schema: what a run is made of, as typed frozen dataclasses.

A topology file (YAML) names
  - `stages`: OS processes (times `replicas`), each hosting one or more *roles* (several =
    colocated, sharing a device: the hybrid engine) with a `backend` and its `options`;
  - `dataflow`: the step as an ordered list of ops `role.op(inputs) -> outputs`, each op
    `scope: micro_batch` (streamed per micro-batch) or `scope: step` (behind the step
    barrier: optimizer step, reshard, weight load). Role `driver` means "computed in the
    coordinator process" (advantages and other cheap batch math);
  - `data`: the prompt source and the value names it provides per sample;
  - `run`: steps, samples per step, micro-batch size, `max_offpolicy_steps`, mode.
  - `checkpoint` (optional): where, how often and how many checkpoints the run keeps
    (`hybridflow run CONFIG --resume` continues from one).

Each section's dataclass lives in a module of its own, and this one is where they are
imported from: run.py (`run`, `data`, `validation`), stages.py (`stages` and their
roles), dataflow.py (`dataflow` ops), runtime.py (`liveness`, `transport`, `metrics`,
`checkpoint`); checks.py holds the value checks and size bounds they share.

Consumes plain data (via `loader.from_dict`); produces a validated `Topology`.
Invariant: a `Topology` that exists passed every check here; checks that need the
backend/data-source/driver registries (which live in stages/ and pipeline/) run in
`hybridflow.pipeline.plan.planner`, because config imports nothing from them.
Every error is a `ConfigError` whose path is the dotted key and whose text says the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.config.checks import NAME, join, require
from hybridflow.config.dataflow import RESERVED_PARAMS, OpConfig
from hybridflow.config.loader import apply_overrides, from_dict, load_yaml
from hybridflow.config.run import DataConfig, RunConfig, ValidationConfig
from hybridflow.config.runtime import (
    NO_METRICS,
    CheckpointConfig,
    LivenessConfig,
    MetricsConfig,
    TrackerOptions,
    TransportConfig,
    is_loopback,
)
from hybridflow.config.stages import DRIVER_ROLE, RoleConfig, StageConfig, is_local_host
from hybridflow.errors import ConfigError

__all__ = [
    "DRIVER_ROLE",
    "LOG_LEVELS",
    "MAX_SEED",
    "NO_METRICS",
    "PRESET_DIR",
    "RESERVED_PARAMS",
    "CheckpointConfig",
    "DataConfig",
    "LivenessConfig",
    "MetricsConfig",
    "OpConfig",
    "RoleConfig",
    "RunConfig",
    "StageConfig",
    "Topology",
    "TrackerOptions",
    "TransportConfig",
    "ValidationConfig",
    "is_local_host",
    "is_loopback",
    "load_topology",
    "preset_names",
    "resolve_config_path",
]

PRESET_DIR = Path(__file__).parent / "presets"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

MAX_SEED = (1 << 63) - 1  # torch, NumPy and the data sources take a 64-bit seed


@dataclass(frozen=True)
class Topology:
    """A whole run: stages, the dataflow between them, sizes, liveness and transport."""

    name: str  # the run's name (letters, digits, _ and -): runs/<name>, tracker names
    stages: dict[str, StageConfig]  # stage name -> its processes and the roles they host
    dataflow: tuple[OpConfig, ...]  # the step: ops in order, each role.op(inputs) -> outputs
    seed: int = 0  # one seed for every stage, the data order and sampling (0 .. 2**63-1)
    run: RunConfig = field(default_factory=RunConfig)  # sizes, steps, off-policy bound
    data: DataConfig = field(default_factory=DataConfig)  # the training data source
    liveness: LivenessConfig = field(default_factory=LivenessConfig)  # heartbeats, timeouts
    transport: TransportConfig = field(default_factory=TransportConfig)  # sockets
    metrics: MetricsConfig = field(default_factory=MetricsConfig)  # metrics sinks
    log_level: str = "WARNING"  # DEBUG, INFO, WARNING or ERROR, for every process
    run_dir: str = ""  # "" = runs/<name>
    checkpoint: CheckpointConfig | None = None  # None: no checkpoints
    validation: ValidationConfig | None = None  # None: no held-out evaluation

    def validate(self, path: str) -> None:
        require(
            0 <= self.seed <= MAX_SEED,
            join(path, "seed"),
            f"must be in 0 .. 2**63-1, got {self.seed}",
        )
        require(
            bool(NAME.match(self.name)),
            join(path, "name"),
            f"{self.name!r} is not a valid name (letters, digits, _ and -; starts with a letter)",
        )
        require(
            self.log_level in LOG_LEVELS,
            join(path, "log_level"),
            f"must be one of {', '.join(LOG_LEVELS)}; got {self.log_level!r}",
        )
        require(bool(self.stages), join(path, "stages"), "must define at least one stage")
        for stage in self.stages:
            require(
                bool(NAME.match(stage)),
                join(path, f"stages.{stage}"),
                f"{stage!r} is not a valid stage name (letters, digits, _ and -)",
            )
        self._check_roles(path)
        self._check_dataflow(path)

    # -- cross-field checks -----------------------------------------------------------
    def role_stage(self) -> dict[str, str]:
        """role name -> the stage hosting it."""
        return {role: stage for stage, cfg in self.stages.items() for role in cfg.roles}

    def _check_roles(self, path: str) -> None:
        seen: dict[str, str] = {}
        for stage, cfg in self.stages.items():
            for role in cfg.roles:
                if role in seen:
                    raise ConfigError(
                        join(path, f"stages.{stage}.roles.{role}"),
                        f"role {role!r} is already hosted by stage {seen[role]!r}; "
                        "a role lives in exactly one stage (use replicas to scale it)",
                    )
                seen[role] = stage

    def _check_dataflow(self, path: str) -> None:
        df = join(path, "dataflow")
        require(bool(self.dataflow), df, "must list at least one op")
        hosted = self.role_stage()
        produced: dict[str, str] = {name: "data" for name in self.data.fields}
        for i, op in enumerate(self.dataflow):
            sub = f"{df}[{i}]"
            if op.role != DRIVER_ROLE and op.role not in hosted:
                raise ConfigError(
                    f"{sub}.role",
                    f"role {op.role!r} is hosted by no stage; add it under "
                    f"stages.<name>.roles or use one of: "
                    f"{', '.join([*sorted(hosted), DRIVER_ROLE])}",
                )
            for name in op.inputs:
                if name not in produced:
                    raise ConfigError(
                        f"{sub}.inputs",
                        f"value {name!r} is consumed by {op.label} before any op produces it; "
                        f"available here: {', '.join(produced)}",
                    )
            for name in op.outputs:
                if name in produced:
                    raise ConfigError(
                        f"{sub}.outputs",
                        f"value {name!r} is already produced by {produced[name]}; "
                        "every value has exactly one producer",
                    )
                produced[name] = f"{df}[{i}] ({op.label})"


# ---------------------------------------------------------------------------------------


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def resolve_config_path(source: str | Path) -> Path:
    """A config argument is a file path or the name of a bundled preset."""
    p = Path(source)
    if p.is_file():
        return p
    preset = PRESET_DIR / f"{source}.yaml"
    if preset.is_file():
        return preset
    raise ConfigError(
        "",
        f"config {str(source)!r} is neither a file nor a bundled preset; "
        f"presets: {', '.join(preset_names()) or '(none)'}",
    )


def load_topology(
    source: str | Path | dict[str, Any], overrides: tuple[str, ...] | list[str] = ()
) -> Topology:
    """File path, preset name or plain dict -> validated Topology (overrides applied first)."""
    data = dict(source) if isinstance(source, dict) else load_yaml(resolve_config_path(source))
    if overrides:
        data = apply_overrides(data, list(overrides))
    return from_dict(Topology, data)

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

Consumes plain data (via `loader.from_dict`); produces a validated `Topology`.
Invariant: a `Topology` that exists passed every check here; checks that need the
backend/data-source/driver registries (which live in stages/ and pipeline/) run in
`hybridflow.pipeline.plan.planner`, because config imports nothing from them.
Every error is a `ConfigError` whose path is the dotted key and whose text says the fix.
"""

from __future__ import annotations

import ipaddress
import math
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import zmq

from hybridflow.config.loader import apply_overrides, from_dict, load_yaml
from hybridflow.errors import ConfigError

PRESET_DIR = Path(__file__).parent / "presets"
DRIVER_ROLE = "driver"  # ops computed in the coordinator process, not in a stage
# Keys the runtime puts into every Task's params; user params may not shadow them.
RESERVED_PARAMS = ("step", "mb_id", "policy_version")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]{0,63}$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_DEVICE = re.compile(r"^(cpu|cuda:\d+)$")
_HOST = re.compile(r"^[A-Za-z0-9_.:-]*$")


def _require(cond: bool, path: str, message: str) -> None:
    if not cond:
        raise ConfigError(path, message)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _at_least(value: float, low: float, path: str) -> None:
    _require(value >= low, path, f"must be >= {low}, got {value}")


def _positive(value: float, path: str) -> None:
    _require(value > 0, path, f"must be > 0, got {value}")


def _at_most(value: float, high: float, path: str, why: str) -> None:
    _require(value <= high, path, f"must be <= {high}, got {value} ({why})")


def _finite_positive(value: float, path: str) -> None:
    _require(0 < value < math.inf, path, f"must be a finite number of seconds > 0, got {value}")


# Upper bounds on sizes the runtime allocates for (a step's samples, its micro-batch
# table, queues): a typo such as `step_batch: 1000000000000` must fail at validate, not
# grow the coordinator's memory until the machine swaps.
MAX_STEP_BATCH = 1 << 20  # samples per step
MAX_MICRO_BATCHES = 1 << 16  # micro-batches per step (step_batch / micro_batch)
MAX_INFLIGHT = 1024  # tasks queued or running per stage replica
MAX_HWM = 1 << 16  # messages queued per socket
MAX_OFFPOLICY_STEPS = 1024  # steps in flight at once


@dataclass(frozen=True)
class RunConfig:
    """How long and how wide a run is, and how much the steps may overlap."""

    steps: int = 1  # RL steps of the run (a resumed run continues up to this many)
    step_batch: int = 8  # samples (rows from the data source) per step
    micro_batch: int = 8  # samples per micro-batch: the unit of streaming
    # 0 = strict on-policy: rollout of step s+1 waits for the step-s reshard.
    # k > 0: step s may start once policy version s-k exists (rollout runs k versions ahead).
    max_offpolicy_steps: int = 0
    # streamed: micro-batch pipelining; sequential: each phase finishes the whole step first.
    mode: Literal["streamed", "sequential"] = "streamed"
    max_inflight: int = 2  # tasks queued or running per stage replica (>= 2 hides latency)

    @property
    def micro_batches(self) -> int:
        return self.step_batch // self.micro_batch

    def validate(self, path: str) -> None:
        for key in ("steps", "step_batch", "micro_batch", "max_inflight"):
            _at_least(getattr(self, key), 1, _join(path, key))
        _at_least(self.max_offpolicy_steps, 0, _join(path, "max_offpolicy_steps"))
        _at_most(
            self.step_batch, MAX_STEP_BATCH, _join(path, "step_batch"), "samples held per step"
        )
        _at_most(self.max_inflight, MAX_INFLIGHT, _join(path, "max_inflight"), "tasks per replica")
        _at_most(
            self.step_batch // self.micro_batch,
            MAX_MICRO_BATCHES,
            _join(path, "micro_batch"),
            "micro-batches per step = run.step_batch / run.micro_batch; raise micro_batch",
        )
        _at_most(
            self.max_offpolicy_steps,
            MAX_OFFPOLICY_STEPS,
            _join(path, "max_offpolicy_steps"),
            "steps in flight at once, each holding its samples",
        )
        if self.step_batch % self.micro_batch:
            divisors = [d for d in range(1, self.step_batch + 1) if self.step_batch % d == 0]
            raise ConfigError(
                _join(path, "micro_batch"),
                f"{self.micro_batch} does not divide run.step_batch {self.step_batch}; "
                f"use one of {', '.join(map(str, divisors[:12]))}",
            )
        if self.mode == "sequential" and self.max_offpolicy_steps:
            raise ConfigError(
                _join(path, "max_offpolicy_steps"),
                f"must be 0 when run.mode is 'sequential' (steps never overlap there), "
                f"got {self.max_offpolicy_steps}",
            )


@dataclass(frozen=True)
class DataConfig:
    """Where prompts come from. `source` names a registered data source (see
    hybridflow.pipeline.sources.registry); `fields` are the per-sample values it provides,
    which the dataflow may consume."""

    source: str = "synthetic"  # a registered data source: prompts | sft | synthetic
    fields: tuple[str, ...] = ("prompt_ids",)  # per-sample values it provides to the dataflow
    options: dict[str, Any] = field(default_factory=dict)  # the source's own options

    def validate(self, path: str) -> None:
        _require(bool(self.fields), _join(path, "fields"), "must name at least one value")
        for i, name in enumerate(self.fields):
            _require(
                bool(_IDENT.match(name)),
                f"{path}.fields[{i}]",
                f"{name!r} is not a valid value name (letters, digits, _)",
            )
        _require(len(set(self.fields)) == len(self.fields), _join(path, "fields"), "has duplicates")


@dataclass(frozen=True)
class RoleConfig:
    """One role hosted by a stage. `kind` picks the implementation family (defaults to the
    role's name: rollout, actor, critic, reference, reward); `backend` picks the
    implementation; `options` go to it verbatim (StageContext.options)."""

    backend: str  # the implementation: hf, native, vllm, function, model, http, zmq, ...
    kind: str = ""  # "" = the role's name (rollout, actor, critic, reference, reward)
    options: dict[str, Any] = field(default_factory=dict)  # the backend's options


@dataclass(frozen=True)
class StageConfig:
    """One stage = `replicas` identical OS processes, each hosting every role listed.
    `devices`: one device for all replicas, or a list with one device per replica.
    `hosts`: where they run, like `devices` (one for all, or one per replica): "" or this
    host's name = here; another name = a node of a multi-host launcher (`hybridflow run
    --launcher ray`: the node started with the resource `hybridflow_host:<name>`, or an
    IP), which then also owns the check that the devices exist there."""

    roles: dict[str, RoleConfig]  # role name -> its backend; several = colocated
    replicas: int = 1  # processes; a trainable role's replicas are FSDP ranks of one model
    devices: str | list[str] = "cpu"  # "cpu" or "cuda:N", for all replicas or one per replica
    hosts: str | list[str] = ""  # "" = this host; or a node name, for all or one per replica

    def device_of(self, replica: int) -> str:
        return self.devices if isinstance(self.devices, str) else self.devices[replica]

    def host_of(self, replica: int) -> str:
        """The replica's host; "" for this one (its own names included)."""
        host = self.hosts if isinstance(self.hosts, str) else self.hosts[replica]
        return "" if is_local_host(host) else host

    def validate(self, path: str) -> None:
        _at_least(self.replicas, 1, _join(path, "replicas"))
        _require(bool(self.roles), _join(path, "roles"), "must host at least one role")
        for name in self.roles:
            _require(
                bool(_IDENT.match(name)) and name != DRIVER_ROLE,
                _join(path, f"roles.{name}"),
                f"{name!r} is not a valid role name"
                + (
                    f" ({DRIVER_ROLE!r} is reserved for coordinator ops)"
                    if name == DRIVER_ROLE
                    else ""
                ),
            )
        devices = [self.devices] if isinstance(self.devices, str) else self.devices
        for i, dev in enumerate(devices):
            sub = _join(path, "devices") + ("" if isinstance(self.devices, str) else f"[{i}]")
            _require(
                bool(_DEVICE.match(dev)), sub, f"{dev!r} is not a device; use 'cpu' or 'cuda:N'"
            )
        if isinstance(self.devices, list) and len(self.devices) != self.replicas:
            raise ConfigError(
                _join(path, "devices"),
                f"lists {len(self.devices)} device(s) for {self.replicas} replica(s); "
                "give one device per replica or a single device string",
            )
        hosts = [self.hosts] if isinstance(self.hosts, str) else self.hosts
        for i, host in enumerate(hosts):
            sub = _join(path, "hosts") + ("" if isinstance(self.hosts, str) else f"[{i}]")
            _require(
                bool(_HOST.match(host)),
                sub,
                f"{host!r} is not a host name (letters, digits, '.', '-', '_', ':')",
            )
        if isinstance(self.hosts, list) and len(self.hosts) != self.replicas:
            raise ConfigError(
                _join(path, "hosts"),
                f"lists {len(self.hosts)} host(s) for {self.replicas} replica(s); "
                "give one host per replica or a single host name",
            )


@dataclass(frozen=True)
class OpConfig:
    """One dataflow op: `role.op(inputs) -> outputs` on each micro-batch or once per step.

    A step-scoped op runs after every op listed before it has finished for the whole step
    (the step barrier); it receives micro-batch values concatenated along dim 0 in mb
    order, and micro-batch ops that consume its outputs get them sliced per micro-batch.
    `phase` names the op in `timing/<phase>` metrics and groups ops for sequential mode.
    `timeout_s` bounds one task of this op: a task not answered within it ends the run with
    an error naming stage, op, step and this key. Unset, the op's default applies (the
    table in pipeline/runtime/watch/deadlines.py and docs/reliability.md: a reward `score` 10 min,
    `generate` 30 min, ...; `liveness.task_timeout_s` for ops the table does not know).
    """

    role: str  # a role some stage hosts, or `driver` (computed in the coordinator)
    op: str  # an op the role's backend declares; for `driver`, a registered op or pkg.mod:attr
    inputs: tuple[str, ...] = ()  # value names the op consumes (data fields or earlier outputs)
    outputs: tuple[str, ...] = ()  # value names it produces; each value has one producer
    # micro_batch: streamed, once per micro-batch; step: once per step, behind the barrier
    scope: Literal["micro_batch", "step"] = "micro_batch"
    phase: str = ""  # default: the op's name
    params: dict[str, Any] = field(default_factory=dict)  # scalars, passed in Task.params
    timeout_s: float | None = None  # None: the op's default (pipeline/runtime/watch/deadlines.py)

    @property
    def phase_name(self) -> str:
        return self.phase or self.op

    @property
    def label(self) -> str:
        return f"{self.role}.{self.op}"

    def validate(self, path: str) -> None:
        _require(
            bool(_IDENT.match(self.op)) or (self.role == DRIVER_ROLE and ":" in self.op),
            _join(path, "op"),
            f"{self.op!r} is not a valid op name (letters, digits, _)",
        )
        if self.timeout_s is not None:
            _finite_positive(self.timeout_s, _join(path, "timeout_s"))
        for key in ("inputs", "outputs"):
            names = getattr(self, key)
            for i, name in enumerate(names):
                _require(
                    bool(_IDENT.match(name)),
                    f"{path}.{key}[{i}]",
                    f"{name!r} is not a valid value name (letters, digits, _)",
                )
            _require(len(set(names)) == len(names), _join(path, key), "has duplicates")
        for key, value in self.params.items():
            sub = _join(path, f"params.{key}")
            _require(key not in RESERVED_PARAMS, sub, "is set by the runtime; rename it")
            _require(
                value is None or isinstance(value, (bool, int, float, str)),
                sub,
                f"must be a scalar (number, string, bool, null), got {type(value).__name__}",
            )
            _require(
                not isinstance(value, float) or math.isfinite(value),
                sub,
                f"must be a finite number, got {value!r}",
            )


@dataclass(frozen=True)
class LivenessConfig:
    """How the coordinator knows a stage is alive, and how long each wait may last."""

    heartbeat_interval_s: float = 1.0  # every stage process sends a heartbeat this often
    heartbeat_timeout_s: float = 10.0  # silence longer than this = the stage is dead
    startup_timeout_s: float = 120.0  # handshake + role setup (model loading) of every stage
    shutdown_timeout_s: float = 5.0  # graceful exit before SIGTERM, then SIGKILL
    # A control call (checkpoint save) answered by every stage process within this bound;
    # the stages keep heartbeating meanwhile, so this bounds slow storage, not death.
    control_timeout_s: float = 600.0
    # The catch-all bound of one task of a stage (or a driver op), counted from when the
    # stage reports it started (its heartbeats list the tasks running), or from when the
    # coordinator started a driver op: for ops without a default of their own in
    # pipeline/runtime/watch/deadlines.py (a reward score 10 min, generate 30 min, ...), and a
    # ceiling on those defaults. `timeout_s` on a dataflow op overrides both.
    task_timeout_s: float = 3600.0
    # While anything is awaited longer than this (a task, a checkpoint save, a driver op,
    # a data batch, stages at startup), a line every interval on the console and in the log
    # names it: stage, op, step, micro-batch, for how long, the stage's last heartbeat and
    # the bound. `hybridflow status RUN_DIR` shows the same for a live run.
    report_interval_s: float = 60.0

    def validate(self, path: str) -> None:
        _finite_positive(self.task_timeout_s, _join(path, "task_timeout_s"))
        _finite_positive(self.report_interval_s, _join(path, "report_interval_s"))
        for key in (
            "heartbeat_interval_s",
            "startup_timeout_s",
            "shutdown_timeout_s",
            "control_timeout_s",
        ):
            _positive(getattr(self, key), _join(path, key))
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                _join(path, "heartbeat_timeout_s"),
                f"must be greater than liveness.heartbeat_interval_s "
                f"({self.heartbeat_interval_s}), got {self.heartbeat_timeout_s}",
            )


@dataclass(frozen=True)
class TransportConfig:
    """The sockets between the coordinator and the stages."""

    # ipc: Unix sockets in ipc_dir (one host); tcp: TCP ports on `host` (multi-host)
    protocol: Literal["ipc", "tcp"] = "ipc"
    ipc_dir: str = ""  # "" = a fresh temporary directory per run
    host: str = "127.0.0.1"  # tcp: the coordinator binds here on a free port
    hwm: int = 256  # ZeroMQ high-water mark: messages queued per socket before sends wait
    shm_threshold: int = 1 << 20  # tensors >= this many bytes go through /dev/shm

    def validate(self, path: str) -> None:
        _at_least(self.hwm, 1, _join(path, "hwm"))
        _at_most(self.hwm, MAX_HWM, _join(path, "hwm"), "messages queued per socket")
        _at_least(self.shm_threshold, 0, _join(path, "shm_threshold"))
        # Peers prove themselves with the run's secret; off this host the sockets must also
        # be authenticated and encrypted: CurveZMQ with per-run keys (transport/curve.py).
        if not is_loopback(self.host) and not zmq.has("curve"):
            raise ConfigError(
                _join(path, "host"),
                f"{self.host!r} is not a loopback address, and sockets off this host need "
                "CurveZMQ, which this libzmq lacks (zmq.has('curve') is False); install a "
                "pyzmq wheel with libsodium/Curve or bind loopback (127.0.0.1)",
            )
        if not is_loopback(self.host) and self.protocol != "tcp":
            raise ConfigError(
                _join(path, "protocol"),
                f"is {self.protocol!r}, but transport.host {self.host!r} is not loopback: "
                "ipc sockets stay on this host; set transport.protocol: tcp",
            )


def is_local_host(name: str) -> bool:
    """Whether a stage's `hosts` entry means this machine."""
    return name in ("", "local", "localhost", "127.0.0.1", socket.gethostname())


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine's loopback (a host name other than localhost: no)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


@dataclass(frozen=True)
class TrackerOptions:
    """`metrics.options`: what the experiment trackers (wandb, mlflow) are told about the
    run (pipeline/observe/trackers.py). "" = the tracker's environment variable
    (WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME, WANDB_NAME), else the topology's name."""

    project: str = ""  # wandb project, mlflow experiment
    run_name: str = ""  # the run's display name in either tracker
    tags: tuple[str, ...] = ()  # wandb tags; mlflow tags with an empty value


@dataclass(frozen=True)
class MetricsConfig:
    """Where each step's metrics go."""

    # Names of registered sinks (hybridflow.pipeline.observe.metrics): console, jsonl,
    # tensorboard, plot, wandb, mlflow, memory, null; several at once.
    backends: tuple[str, ...] = ("jsonl",)
    options: TrackerOptions = field(default_factory=TrackerOptions)  # wandb / mlflow names
    # Generations per step written to <run_dir>/samples.jsonl (with the jsonl backend):
    # prompt, response, reward, the scorer's fields, and each turn of a multi-turn
    # trajectory; a validation adds as many marked split "val". `hybridflow view` shows
    # them. 0: none.
    samples_per_step: int = 4

    def validate(self, path: str) -> None:
        _at_least(self.samples_per_step, 0, _join(path, "samples_per_step"))


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often a run checkpoints (pipeline/checkpoint/store.py writes them).

    The YAML `checkpoint:` section and the Python API's `Engine.save_checkpoint` both
    make one. A checkpoint is taken after every `save_interval` steps and after the last
    step; `keep_last` complete checkpoints are kept; `export_final` writes the final
    policy into the last one (`policy/`, save_pretrained)."""

    save_dir: str = ""  # "" = <run_dir>/checkpoints (a topology's; the API requires one)
    save_interval: int = 0  # steps between checkpoints; 0: only after the last step
    keep_last: int = 3  # complete checkpoints kept (older ones deleted); 0: keep all
    export_final: bool = True  # save_pretrained the policy into the final checkpoint

    def validate(self, path: str = "") -> None:
        _at_least(self.save_interval, 0, _join(path, "save_interval"))
        _at_least(self.keep_last, 0, _join(path, "keep_last"))


@dataclass(frozen=True)
class ValidationConfig:
    """Held-out evaluation between training steps (pipeline/runtime/validation.py).

    The same stage processes run the dataflow's generate and score ops (no update) on
    `source`, read through the training data source's options (tokenizer, prompt_key,
    chat template, ...), with the sampling overrides below; the metrics carry a `val/`
    prefix and go to the run's sinks at the step they describe (the policy after that
    many updates): `val/reward/mean`, `val/<data_source>/<metric>/mean` for the reward and
    each scorer metric, with n > 1 also `mean@n`, `best@n` and (when the scorer returns
    `pred`) `maj@n`; `val/response_length/mean`."""

    source: str = ""  # a .jsonl / .json / .parquet file, a datasets directory, task:NAME
    interval: int = 0  # steps between validations; 0: only before/after training
    before_train: bool = True  # validate the initial policy (verl's val_before_train)
    after_train: bool = True  # and the final one
    max_prompts: int = 0  # the first N prompts of the source; 0: all of them
    temperature: float = 0.0  # 0 = greedy (verl's val_kwargs default)
    top_p: float = 1.0  # nucleus sampling override; 1 = off
    n: int = 1  # samples per prompt; > 1 needs temperature > 0
    max_new_tokens: int | None = None  # None: the rollout's own
    micro_batch: int = 0  # samples per micro-batch; 0: run.micro_batch (a multiple of n)
    generations: int = 0  # samples written to <run_dir>/val_generations.jsonl per validation
    split: str | None = None  # for a datasets directory with several splits

    def validate(self, path: str) -> None:
        _require(
            bool(self.source),
            _join(path, "source"),
            "is required: a file, a directory or task:NAME",
        )
        for key in ("interval", "max_prompts", "micro_batch", "generations"):
            _at_least(getattr(self, key), 0, _join(path, key))
        _at_least(self.n, 1, _join(path, "n"))
        _at_least(self.temperature, 0, _join(path, "temperature"))
        _require(0 < self.top_p <= 1, _join(path, "top_p"), f"must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens is not None:
            _at_least(self.max_new_tokens, 1, _join(path, "max_new_tokens"))
        if self.n > 1 and self.temperature == 0:
            raise ConfigError(
                _join(path, "n"),
                f"is {self.n}, but greedy decoding (temperature 0) gives {self.n} identical "
                "samples; set validation.temperature > 0 for mean@n / best@n / maj@n",
            )
        if self.micro_batch and self.micro_batch % self.n:
            raise ConfigError(
                _join(path, "micro_batch"),
                f"{self.micro_batch} is not a multiple of validation.n {self.n} "
                "(a prompt's samples stay in one micro-batch)",
            )


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
        _require(
            0 <= self.seed <= MAX_SEED,
            _join(path, "seed"),
            f"must be in 0 .. 2**63-1, got {self.seed}",
        )
        _require(
            bool(_NAME.match(self.name)),
            _join(path, "name"),
            f"{self.name!r} is not a valid name (letters, digits, _ and -; starts with a letter)",
        )
        _require(
            self.log_level in LOG_LEVELS,
            _join(path, "log_level"),
            f"must be one of {', '.join(LOG_LEVELS)}; got {self.log_level!r}",
        )
        _require(bool(self.stages), _join(path, "stages"), "must define at least one stage")
        for stage in self.stages:
            _require(
                bool(_NAME.match(stage)),
                _join(path, f"stages.{stage}"),
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
                        _join(path, f"stages.{stage}.roles.{role}"),
                        f"role {role!r} is already hosted by stage {seen[role]!r}; "
                        "a role lives in exactly one stage (use replicas to scale it)",
                    )
                seen[role] = stage

    def _check_dataflow(self, path: str) -> None:
        df = _join(path, "dataflow")
        _require(bool(self.dataflow), df, "must list at least one op")
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

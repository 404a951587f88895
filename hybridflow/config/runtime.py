"""How the runtime watches, connects and records a run: `liveness:` (heartbeats and
every bound on a wait), `transport:` (the sockets), `metrics:` (sinks and trackers) and
`checkpoint:`."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Literal

import zmq

from hybridflow.config.checks import (
    MAX_HWM,
    at_least,
    at_most,
    finite_positive,
    join,
    positive,
    require,
)
from hybridflow.errors import ConfigError


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
        finite_positive(self.task_timeout_s, join(path, "task_timeout_s"))
        finite_positive(self.report_interval_s, join(path, "report_interval_s"))
        for key in (
            "heartbeat_interval_s",
            "startup_timeout_s",
            "shutdown_timeout_s",
            "control_timeout_s",
        ):
            positive(getattr(self, key), join(path, key))
        require(
            self.heartbeat_timeout_s > self.heartbeat_interval_s,
            join(path, "heartbeat_timeout_s"),
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
        at_least(self.hwm, 1, join(path, "hwm"))
        at_most(self.hwm, MAX_HWM, join(path, "hwm"), "messages queued per socket")
        at_least(self.shm_threshold, 0, join(path, "shm_threshold"))
        # Peers prove themselves with the run's secret; off this host the sockets must also
        # be authenticated and encrypted: CurveZMQ with per-run keys (transport/curve.py).
        if not is_loopback(self.host) and not zmq.has("curve"):
            raise ConfigError(
                join(path, "host"),
                f"{self.host!r} is not a loopback address, and sockets off this host need "
                "CurveZMQ, which this libzmq lacks (zmq.has('curve') is False); install a "
                "pyzmq wheel with libsodium/Curve or bind loopback (127.0.0.1)",
            )
        if not is_loopback(self.host) and self.protocol != "tcp":
            raise ConfigError(
                join(path, "protocol"),
                f"is {self.protocol!r}, but transport.host {self.host!r} is not loopback: "
                "ipc sockets stay on this host; set transport.protocol: tcp",
            )


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
        at_least(self.samples_per_step, 0, join(path, "samples_per_step"))


# The metrics of a side job that leaves no trace of its own (a validation job, an Engine's
# generation): its steps are not the run's; what it measures is reported by its caller.
NO_METRICS = MetricsConfig(backends=("null",))


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often a run checkpoints (pipeline/checkpoint/checkpointer.py writes them).

    The YAML `checkpoint:` section and the Python API's `Engine.save_checkpoint` both
    make one. A checkpoint is taken after every `save_interval` steps and after the last
    step; `keep_last` complete checkpoints are kept; `export_final` writes the final
    policy into the last one (`policy/`, save_pretrained)."""

    save_dir: str = ""  # "" = <run_dir>/checkpoints (a topology's; the API requires one)
    save_interval: int = 0  # steps between checkpoints; 0: only after the last step
    keep_last: int = 3  # complete checkpoints kept (older ones deleted); 0: keep all
    export_final: bool = True  # save_pretrained the policy into the final checkpoint

    def validate(self, path: str = "") -> None:
        at_least(self.save_interval, 0, join(path, "save_interval"))
        at_least(self.keep_last, 0, join(path, "keep_last"))

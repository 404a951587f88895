"""Metrics sinks: where each step's metrics go (`metrics.backends` in a topology).

Per step the coordinator produces one flat dict: the mean of every metric the roles
returned for that step (over micro-batches and replicas), plus `timing/<phase>` (wall
seconds from the phase's first dispatch to its last result in this step),
`timing/step` and `policy_version` (the oldest policy that produced the step's samples).

A sink receives `write(step, metrics)` in step order, from the coordinator's executor
thread (never the event loop), and `close()` once. Sinks are registered by name ->
"module:Class", constructed as Class(run_dir: Path); later additions (console,
tensorboard, wandb) register themselves the same way.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Protocol

from hybridflow.errors import ConfigError

StepMetrics = dict[str, float]


class MetricsSink(Protocol):
    def write(self, step: int, metrics: StepMetrics) -> None: ...
    def close(self) -> None: ...


SINKS: dict[str, str] = {
    "jsonl": "hybridflow.pipeline.metrics:JsonlSink",
    "memory": "hybridflow.pipeline.metrics:MemorySink",
}


def register_sink(name: str, target: str) -> None:
    SINKS[name] = target


def check_sinks(names: tuple[str, ...] | list[str]) -> None:
    for i, name in enumerate(names):
        if name not in SINKS:
            raise ConfigError(
                f"metrics.backends[{i}]",
                f"unknown metrics backend {name!r}; known: {', '.join(sorted(SINKS))}",
            )


def make_sinks(names: tuple[str, ...] | list[str], run_dir: Path) -> list[MetricsSink]:
    check_sinks(names)
    sinks = []
    for name in names:
        module, cls = SINKS[name].split(":")
        sinks.append(getattr(importlib.import_module(module), cls)(run_dir))
    return sinks


class JsonlSink:
    """`<run_dir>/metrics.jsonl`, one JSON object per step with `step` included."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._f = self.path.open("w")

    def write(self, step: int, metrics: StepMetrics) -> None:
        # NaN/inf are not JSON; write them as null rather than emitting invalid lines.
        row = {"step": step} | {
            k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None)
            for k, v in metrics.items()
        }
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class MemorySink:
    """Keeps rows in memory (tests, benchmarks, the Python API)."""

    def __init__(self, run_dir: Path | None = None) -> None:
        self.rows: list[StepMetrics] = []

    def write(self, step: int, metrics: StepMetrics) -> None:
        self.rows.append({"step": float(step), **metrics})

    def close(self) -> None:
        pass

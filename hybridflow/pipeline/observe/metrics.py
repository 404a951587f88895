"""Metrics sinks: where each step's metrics go (`metrics.backends` in a topology).

Per step the coordinator produces one flat dict: every metric the roles and driver ops
returned for that step, combined over micro-batches and replicas by `reduce_step_metric`:
counters are SUMMED, everything else is averaged. A counter is a metric whose last path
component is, or ends in `_` + one of, `count`, `failures`, `retries`, `requests`,
`tokens` (`reward/service_failures`, `reward/service_requests`, `rollout/tokens`: 128
fallback samples over 4 micro-batches show as 128, not 32); rates and means never match
(`rollout/tokens_per_s`, `reward/mean`). Plus
`timing/<phase>` (wall seconds from the phase's first dispatch to its last result in
this step), `compute/<phase>`, `timing/step` (the step's latency: its start to its
finish), `timing/period` (the previous step's finish to this one's: with
max_offpolicy_steps > 0 steps overlap and the period is shorter than the latency) and
`policy_version` (the oldest policy that produced the step's samples), plus what
`derive_step_metrics` adds:
  reward/std          from reward/mean and reward/sq_mean (equal-sized micro-batches, so
                      the step's std is exact); reward/sq_mean itself is dropped
  perf/samples_per_s  run.step_batch / timing/period (throughput)
  perf/tokens_per_s   (prompt_length/mean + response_length/mean) * step_batch /
                      timing/period (prompt and response tokens, verl's convention)

A sink receives `write(step, metrics)` in step order, from the coordinator's io thread
(never the event loop), and `close()` once, also after a failed run. Sinks are
registered by name -> "module:Class" and built as `Class(run_dir)`, or as
`Class(run_dir, topology=topo)` when the constructor takes a `topology` keyword (the
console needs the step count). Sinks with `CLOSE_LAST = True` (the console, whose
summary names the files the others wrote) are closed after the rest.

Sinks that take `start_step` continue a resumed run (start_step > 0) instead of starting
anew: the jsonl file keeps its earlier rows, TensorBoard its event files, the trackers
their run id. Several sinks at once are the norm (`backends: [console, jsonl, wandb]`).

Built-in sinks:
  jsonl        <run_dir>/metrics.jsonl, one JSON object per step with `step`
  tensorboard  TensorBoard event files in <run_dir> (`tensorboard --logdir runs`)
  wandb        Weights & Biases, files under <run_dir>/wandb (trackers.py)
  mlflow       MLflow, by default a SQLite store in <run_dir>/mlflow (trackers.py)
  console      a rich progress bar over steps, one line of key metrics per step, and a
               summary at the end (first/last 10% reward, the files written)
  plot         <run_dir>/plot.png at the end: reward, response length and KL per step
  (samples)    with jsonl and metrics.samples_per_step > 0, <run_dir>/samples.jsonl: a
               few generations per step as text (samples.py); not named in backends
  memory       rows kept in memory (tests, benchmarks, the Python API)
  null         discards everything
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hybridflow.config.imports import load_attr
from hybridflow.errors import ConfigError

if TYPE_CHECKING:
    from hybridflow.config.schema import Topology

StepMetrics = dict[str, float]


class MetricsSink(Protocol):
    def write(self, step: int, metrics: StepMetrics) -> None: ...
    def close(self) -> None: ...


SINKS: dict[str, str] = {
    "jsonl": "hybridflow.pipeline.observe.metrics:JsonlSink",
    "memory": "hybridflow.pipeline.observe.metrics:MemorySink",
    "null": "hybridflow.pipeline.observe.metrics:NullSink",
    "tensorboard": "hybridflow.pipeline.observe.metrics:TensorBoardSink",
    "console": "hybridflow.pipeline.observe.console:ConsoleSink",
    "plot": "hybridflow.pipeline.observe.plot:PlotSink",
    "wandb": "hybridflow.pipeline.observe.trackers:WandbSink",
    "mlflow": "hybridflow.pipeline.observe.trackers:MlflowSink",
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
        if name in names[:i]:
            raise ConfigError(f"metrics.backends[{i}]", f"{name!r} is listed twice")
    from hybridflow.pipeline.observe.trackers import check_requirements

    check_requirements(names)  # an uninstalled tracker fails here, not at the first step


def make_sinks(
    names: tuple[str, ...] | list[str],
    run_dir: Path,
    topology: Topology | None = None,
    start_step: int = 0,
) -> list[MetricsSink]:
    """Build the named sinks, in order, except that CLOSE_LAST sinks go to the end.
    Sinks that take `start_step` continue a resumed run's files instead of starting anew."""
    check_sinks(names)
    sinks: list[MetricsSink] = []
    try:
        for i, name in enumerate(names):
            cls = load_attr(SINKS[name], f"metrics.backends[{name!r}]")
            accepts = inspect.signature(cls).parameters
            kwargs: dict[str, Any] = {}
            if "topology" in accepts:
                kwargs["topology"] = topology
            if "start_step" in accepts:
                kwargs["start_step"] = start_step
            try:
                sinks.append(cls(run_dir, **kwargs))
            except Exception as exc:  # e.g. a tracker without credentials: name it, stop
                raise ConfigError(
                    f"metrics.backends[{i}]",
                    f"the {name!r} sink could not start: {type(exc).__name__}: {exc}",
                ) from exc
        wanted = topology.metrics.samples_per_step if topology is not None else 0
        if wanted and "jsonl" in names:  # samples.jsonl beside metrics.jsonl (samples.py)
            from hybridflow.pipeline.observe.samples import SamplesSink

            sinks.append(SamplesSink(run_dir, wanted, topology, start_step))
    except BaseException:
        for sink in sinks:  # the ones already open (files, tracker runs) are closed
            with contextlib.suppress(Exception):
                sink.close()
        raise
    return sorted(sinks, key=lambda s: bool(getattr(s, "CLOSE_LAST", False)))


# Counter words (module docstring): a metric named by one is summed over a step's tasks.
SUM_WORDS = ("count", "failures", "retries", "requests", "tokens")
_SUM_SUFFIXES = tuple(f"_{w}" for w in SUM_WORDS)


def is_counter(key: str) -> bool:
    """True if metric `key` is a count to sum over a step's tasks (module docstring)."""
    last = key.rsplit("/", 1)[-1]
    return last in SUM_WORDS or last.endswith(_SUM_SUFFIXES)


def reduce_step_metric(key: str, total: float, n: int) -> float:
    """The step's value of metric `key` from the sum and number of its task values."""
    return total if is_counter(key) else total / n


def derive_step_metrics(metrics: StepMetrics, step_batch: int) -> None:
    """Add the derived per-step metrics (module docstring) to `metrics`, in place."""
    if "reward/sq_mean" in metrics and "reward/mean" in metrics:
        var = metrics.pop("reward/sq_mean") - metrics["reward/mean"] ** 2
        metrics["reward/std"] = math.sqrt(max(var, 0.0))
    # Throughput over the period, not the latency: overlapping steps (k > 0) would
    # otherwise be counted as if they ran one after another.
    step_s = metrics.get("timing/period") or metrics.get("timing/step", 0.0)
    if step_s > 0:
        metrics["perf/samples_per_s"] = step_batch / step_s
        if "response_length/mean" in metrics:
            per_sample = metrics["response_length/mean"] + metrics.get("prompt_length/mean", 0.0)
            metrics["perf/tokens_per_s"] = per_sample * step_batch / step_s


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


class JsonlSink:
    """`<run_dir>/metrics.jsonl`, one JSON object per step with `step` included.

    A fresh run (start_step 0) overwrites the file; a run resumed at step r keeps the rows
    of steps < r and continues after them, so the file reads as one unbroken run."""

    def __init__(self, run_dir: Path, start_step: int = 0) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        kept: list[str] = []
        if start_step > 0 and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash: the resumed run rewrites that step
                step = row.get("step") if isinstance(row, dict) else None
                if isinstance(step, int) and step < start_step:
                    kept.append(line)
        self._f = self.path.open("w")
        self._f.writelines(line + "\n" for line in kept)

    def write(self, step: int, metrics: StepMetrics) -> None:
        # NaN/inf are not JSON; write them as null rather than emitting invalid lines.
        row = {"step": step} | {k: (v if _finite(v) else None) for k, v in metrics.items()}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    """TensorBoard event files in `<run_dir>`; one scalar per metric per step.

    A fresh run (start_step 0) removes the event files of an earlier run with the same
    run directory first (as metrics.jsonl is overwritten), so TensorBoard never shows two
    runs as one. A run resumed at step r keeps them and adds its own file beside them,
    opened with `purge_step=r`: that file starts with a SessionLog START event at step r,
    on which TensorBoard drops the earlier files' events at steps >= r (those a crash
    left after the checkpoint). So the directory reads as one run, each step once."""

    def __init__(self, run_dir: Path, start_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        run_dir.mkdir(parents=True, exist_ok=True)
        if start_step == 0:
            for old in run_dir.glob("events.out.tfevents.*"):
                old.unlink()
        self.path = run_dir
        self._w = SummaryWriter(log_dir=str(run_dir), flush_secs=10, purge_step=start_step or None)

    def write(self, step: int, metrics: StepMetrics) -> None:
        for key, value in metrics.items():
            if _finite(value):
                self._w.add_scalar(key, value, global_step=step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class MemorySink:
    """Keeps rows in memory (tests, benchmarks, the Python API)."""

    def __init__(self, run_dir: Path | None = None) -> None:
        self.rows: list[StepMetrics] = []

    def write(self, step: int, metrics: StepMetrics) -> None:
        self.rows.append({"step": float(step), **metrics})

    def close(self) -> None:
        pass


class NullSink:
    """Discards everything (benchmarks that measure the runtime alone)."""

    def __init__(self, run_dir: Path | None = None) -> None:
        pass

    def write(self, step: int, metrics: StepMetrics) -> None:
        pass

    def close(self) -> None:
        pass

"""The `console` metrics sink: what a person watching a run sees in the terminal.

    grpo  ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━ 12/60 0:00:31 < 0:01:59   reward 0.412
    step  11  reward 0.412±0.31  len 1.9  kl 0.0123  pg -0.004  ent 1.23  1.41s  45 samples/s

A rich progress bar over the run's steps (started when the sink is built, so the
startup shows as elapsed time), one line of key metrics per finished step printed above
it, a `val` line for each validation row (the bar does not move for those), and at
close a summary: steps done, the first-10% / last-10% mean reward, the first and last
validation reward, and the files the other sinks wrote (metrics.jsonl, TensorBoard, plot.png). `CLOSE_LAST` makes
the runtime close it after those sinks, so the files exist when it names them.

Called from the coordinator's io thread; rich's Progress is thread-safe.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from hybridflow.pipeline.observe.plot import PLOT_FILE, reward_summary
from hybridflow.pipeline.observe.validation import PREFIX as VAL_PREFIX
from hybridflow.pipeline.observe.validation import is_validation_row

if TYPE_CHECKING:
    from hybridflow.config.schema import Topology

# (metric, label, format); a metric missing from a step is left out of its line.
KEY_METRICS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("response_length/mean", "len", "{:.1f}"),
    ("actor/kl", "kl", "{:.4f}"),
    ("actor/pg_loss", "pg", "{:+.3f}"),
    ("critic/vf_loss", "vf", "{:.4f}"),
    ("actor/entropy", "ent", "{:.2f}"),
)


def metrics_line(step: int, m: dict[str, float]) -> str:
    parts = [f"step {step:>4}"]
    for key, label, fmt in KEY_METRICS:
        v = m.get(key)
        if v is None or not math.isfinite(v):
            continue
        text = fmt.format(v)
        if key == "reward/mean" and math.isfinite(m.get("reward/std", math.nan)):
            text += f"±{m['reward/std']:.2f}"
        parts.append(f"{label} {text}")
    if "timing/step" in m:
        parts.append(f"{m['timing/step']:.2f}s")
    if "perf/samples_per_s" in m:
        parts.append(f"{m['perf/samples_per_s']:.0f} samples/s")
    return "  ".join(parts)


def validation_line(step: int, m: dict[str, float]) -> str:
    """`val  step   10  reward 0.432  openai/gsm8k acc 0.410  len 87.2  3.1s`: the mean
    reward, then each data source's scorer means (reward aside), length and time."""
    parts = [f"val  step {step:>4}"]
    if math.isfinite(m.get("val/reward/mean", math.nan)):
        parts.append(f"reward {m['val/reward/mean']:.3f}")
    for key, v in m.items():
        name = key.removeprefix(VAL_PREFIX)
        if not name.endswith("/mean") or name.count("/") < 2 or not math.isfinite(v):
            continue
        source, metric = name.removesuffix("/mean").rsplit("/", 1)
        if metric != "reward":
            parts.append(f"{source} {metric} {v:.3f}")
    if math.isfinite(m.get("val/response_length/mean", math.nan)):
        parts.append(f"len {m['val/response_length/mean']:.1f}")
    if "val/time_s" in m:
        parts.append(f"{m['val/time_s']:.1f}s")
    return "  ".join(parts)


class ConsoleSink:
    CLOSE_LAST = True

    def __init__(self, run_dir: Path, topology: Topology | None = None) -> None:
        self.run_dir = run_dir
        self.topology = topology
        self.total = topology.run.steps if topology is not None else None
        self.backends = tuple(topology.metrics.backends) if topology is not None else ()
        self.console = Console(highlight=False, soft_wrap=True)
        self.rows: list[dict[str, float]] = []
        self.val_rows: list[dict[str, float]] = []
        self._t0 = time.perf_counter()
        name = topology.name if topology is not None else "run"
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("<"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[live]}"),
            console=self.console,
        )
        self.task = self.progress.add_task(name, total=self.total, live="starting stages...")
        self.progress.start()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if is_validation_row(metrics):  # between steps: a line, the bar does not move
            self.val_rows.append({"step": float(step), **metrics})
            self.progress.console.print(validation_line(step, metrics))
            return
        self.rows.append({"step": float(step), **metrics})
        self.progress.console.print(metrics_line(step, metrics))
        live = ""
        if "reward/mean" in metrics:
            live = f"reward {metrics['reward/mean']:.3f}"
        self.progress.update(self.task, advance=1, live=live)

    def close(self) -> None:
        self.progress.stop()
        done, wall = len(self.rows), time.perf_counter() - self._t0
        head = f"{done} step(s)" + (
            f" of {self.total}" if self.total is not None and done < self.total else ""
        )
        self.console.print(f"[bold]summary[/bold]: {head} in {wall:.1f}s (startup included)")
        summary = reward_summary(self.rows)
        if summary is not None:
            self.console.print(summary.text())
        val = [r for r in self.val_rows if math.isfinite(r.get("val/reward/mean", math.nan))]
        if val:
            first, last = val[0], val[-1]
            self.console.print(
                f"val/reward/mean: step {first['step']:.0f} {first['val/reward/mean']:.3f} -> "
                f"step {last['step']:.0f} {last['val/reward/mean']:.3f} ({len(val)} validations)"
            )
        files = {
            "metrics": self.run_dir / "metrics.jsonl" if "jsonl" in self.backends else None,
            # beside metrics.jsonl (observe/samples.py); `hybridflow view RUN_DIR` reads both
            "samples": self.run_dir / "samples.jsonl" if "jsonl" in self.backends else None,
            "tensorboard": self.run_dir if "tensorboard" in self.backends else None,
            "plot": self.run_dir / PLOT_FILE if "plot" in self.backends else None,
            "wandb": self.run_dir / "wandb" if "wandb" in self.backends else None,
            "mlflow": self.run_dir / "mlflow" if "mlflow" in self.backends else None,
        }
        for label, path in files.items():
            if path is not None and path.exists():
                self.console.print(f"{label}: {path}")

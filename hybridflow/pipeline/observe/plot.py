"""The run plot (PNG) and the reward summary: what a person looks at after a run.

Consumes metric rows (one dict per step, `step` included: what the sinks receive);
produces `<run_dir>/plot.png` with three panels over steps — reward (mean, with a
+-std band when present, and the validation reward `val/reward/mean` where the run
validated), response length, and KL to the reference
(`actor/kl`, or `reward/kl` where the KL is a reward penalty) — and `reward_summary`,
the first-10% / last-10% mean reward that the console and the demo print.

matplotlib runs headless through its object API (Figure + Agg canvas): no pyplot, no
global state, safe from the metrics io thread. It is imported only when a plot is made.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridflow.config.schema import Topology

Row = dict[str, float]
PLOT_FILE = "plot.png"


@dataclass(frozen=True)
class RewardSummary:
    steps: int  # steps with a reward/mean
    window: int  # steps in each 10% window (at least 1)
    first: float  # mean reward/mean over the first `window` steps
    last: float  # ... over the last `window` steps

    @property
    def ratio(self) -> float:
        return self.last / self.first if self.first > 0 else math.inf

    def text(self) -> str:
        return (
            f"reward/mean: first 10% of steps {self.first:.3f} -> last 10% {self.last:.3f} "
            f"(x{self.ratio:.2f}, {self.window} of {self.steps} steps each)"
        )


def reward_summary(rows: Sequence[Row], key: str = "reward/mean") -> RewardSummary | None:
    values = [r[key] for r in rows if _finite(r.get(key))]
    if not values:
        return None
    w = max(1, round(len(values) * 0.1))
    return RewardSummary(len(values), w, sum(values[:w]) / w, sum(values[-w:]) / w)


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _series(rows: Sequence[Row], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if _finite(r.get(key))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(rows: Sequence[Row], path: Path, title: str = "") -> Path | None:
    """Write the three-panel PNG; None (and no file) when no row has a reward."""
    if not any(_finite(r.get("reward/mean")) for r in rows):
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.4), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax_r, ax_l, ax_k = fig.subplots(1, 3)

    x, mean = _series(rows, "reward/mean")
    ax_r.plot(x, mean, color="tab:blue", label="mean")
    xs, std = _series(rows, "reward/std")
    if xs == x:
        lo = [m - s for m, s in zip(mean, std, strict=True)]
        hi = [m + s for m, s in zip(mean, std, strict=True)]
        ax_r.fill_between(x, lo, hi, color="tab:blue", alpha=0.15, label="+-std")
    vx, vv = _series(rows, "val/reward/mean")  # validation rows, at the steps they describe
    if vx:
        ax_r.plot(vx, vv, color="tab:orange", marker="o", markersize=4, label="validation")
    summary = reward_summary(rows)
    if summary is not None:
        ax_r.set_title(f"reward  {summary.first:.2f} -> {summary.last:.2f} (first/last 10%)")
    ax_r.legend(loc="lower right", fontsize=8)

    lx, lv = _series(rows, "response_length/mean")
    ax_l.plot(lx, lv, color="tab:green")
    ax_l.set_ylim(bottom=0, top=max(lv, default=1.0) * 1.15 or 1.0)
    ax_l.set_title("response length (tokens)")

    kl_key = "actor/kl" if any(_finite(r.get("actor/kl")) for r in rows) else "reward/kl"
    kx, kv = _series(rows, kl_key)
    ax_k.plot(kx, kv, color="tab:red")
    ax_k.set_title(f"KL to reference ({kl_key})")

    for ax in (ax_r, ax_l, ax_k):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


class PlotSink:
    """Keeps the rows; writes `<run_dir>/plot.png` at close (also after a failed run:
    the steps that finished are worth a look)."""

    def __init__(self, run_dir: Path, topology: Topology | None = None) -> None:
        self.path = run_dir / PLOT_FILE
        self.title = topology.name if topology is not None else ""
        self.rows: list[Row] = []
        self.written: Path | None = None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append({"step": float(step), **metrics})

    def close(self) -> None:
        self.written = plot_run(self.rows, self.path, self.title)

"""`python bench/demo_seeds.py [SEED ...] [--set KEY=VALUE ...]`: the demo over several seeds.

Runs `hybridflow demo` (the bundled `demo` preset) once per seed, one after another (never
side by side: the RL wall time is part of the claim, and two runs on a 2-core machine
would slow each other down), each in its own run directory `<--run-root>/s<SEED>`, and
reads back the `summary.json` the demo writes. `--set` overrides go to every run.

Prints one JSON object per line: one per seed as it finishes, then a summary:
  {"seed", "reward_first_10pct", "reward_last_10pct", "ratio", "rl_s", "startup_s",
   "wall_s", "steps", "demo_rc", "load_1m_before", "load_1m_after", "ok"}
  {"summary": true, "seeds", "goal_last_10pct", "reward_last_10pct_min"/"_mean",
   "ratio_min", "rl_s_max"/"_mean", "misses", "ok"}
`rl_s` is the demo's own RL wall time (startup excluded); `wall_s` is the demo command's
(startup included). `load_1m_*` is the 1-minute load average just before and just after
the run: wall times measured beside other busy processes read high, and say so here.
`demo_rc` is the demo's exit status (1 when its ratio goal >= x2 was missed).

Exit status 0 when every seed reaches `--goal` (default 0.8) mean reward over the last
10% of RL steps, 1 when any seed misses it or fails to write a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

GOAL_LAST = 0.8  # mean reward over the last 10% of RL steps, for every seed


def run_seed(seed: int, overrides: list[str], run_root: Path, goal: float) -> dict[str, Any]:
    run_dir = run_root / f"s{seed}"
    summary = run_dir / "summary.json"
    summary.unlink(missing_ok=True)  # a stale summary must not pass for this run's
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hybridflow", "demo", "--set", f"seed={seed}"]
    cmd += ["--set", f"run_dir={run_dir}"]
    for kv in overrides:
        cmd += ["--set", kv]
    load_before = os.getloadavg()[0]
    with open(run_dir / "demo.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    load_after = os.getloadavg()[0]
    row: dict[str, Any] = {"seed": seed}
    if summary.is_file():
        s = json.loads(summary.read_text())
        keys = ("reward_first_10pct", "reward_last_10pct", "ratio", "rl_s", "startup_s")
        row.update({k: s[k] for k in (*keys, "wall_s", "steps")})
        row["ok"] = s["reward_last_10pct"] >= goal
    else:
        row.update(ok=False, error=f"no {summary} (see {run_dir / 'demo.log'})")
    row.update(demo_rc=rc, load_1m_before=round(load_before, 2), load_1m_after=round(load_after, 2))
    return row


def summarize(rows: list[dict[str, Any]], goal: float) -> dict[str, Any]:
    done = [r for r in rows if "reward_last_10pct" in r]
    last = [r["reward_last_10pct"] for r in done]
    rl = [r["rl_s"] for r in done]
    out: dict[str, Any] = {
        "summary": True,
        "seeds": [r["seed"] for r in rows],
        "goal_last_10pct": goal,
        "misses": [r["seed"] for r in rows if not r["ok"]],
    }
    if done:
        out.update(
            reward_last_10pct_min=min(last),
            reward_last_10pct_mean=round(sum(last) / len(last), 4),
            ratio_min=min(r["ratio"] for r in done),
            rl_s_max=max(rl),
            rl_s_mean=round(sum(rl) / len(rl), 1),
        )
    out["ok"] = not out["misses"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("seeds", nargs="*", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--goal", type=float, default=GOAL_LAST, help="last-10%% reward per seed")
    p.add_argument("--run-root", type=Path, default=Path("runs/demo-seeds"))
    args = p.parse_args(argv)
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(seed, args.overrides, args.run_root, args.goal))
        print(json.dumps(rows[-1]), flush=True)
    summary = summarize(rows, args.goal)
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

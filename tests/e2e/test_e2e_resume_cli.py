"""A YAML-launched run checkpoints, dies by SIGKILL and resumes bit-exactly (issue 12,
item 10): `hybridflow run grpo` (shrunk, `checkpoint.save_interval: 1`) as a real
subprocess, killed once a checkpoint exists, then `hybridflow run --resume latest`;
the metrics of every step after the checkpoint equal an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import read_jsonl

STEPS = 30


def _cmd(run_dir: Path, *extra: str) -> list[str]:
    sets = [
        f"run_dir={run_dir}",
        f"run.steps={STEPS}",
        "run.step_batch=16",
        "run.micro_batch=8",
        "metrics.backends=[jsonl]",
        "checkpoint.save_interval=1",
        "checkpoint.keep_last=2",
    ]
    args = [a for s in sets for a in ("--set", s)]
    return [sys.executable, "-m", "hybridflow", "run", "grpo", *args, *extra]


def _deterministic(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row without wall-clock measurements (timings, rates, seconds)."""
    clock = ("timing/", "compute/", "perf/")
    return {k: v for k, v in row.items() if not k.startswith(clock) and not k.endswith("_s")}


@pytest.mark.timeout(300)
def test_yaml_run_killed_after_a_checkpoint_resumes_bit_exact(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    done = subprocess.run(_cmd(whole), env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    final = whole / "checkpoints" / f"step-{STEPS:08d}"
    assert (whole / "checkpoints" / "latest").read_text().strip() == final.name
    assert (final / "policy" / "config.json").is_file()  # export_final: save_pretrained
    assert len(list((whole / "checkpoints").glob("step-*"))) == 2  # keep_last

    proc = subprocess.Popen(
        _cmd(broken), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    latest = broken / "checkpoints" / "latest"
    deadline = time.monotonic() + 200
    while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    name = latest.read_text().strip()
    assert (broken / "checkpoints" / name / "meta.json").is_file()  # committed whole
    k = int(name.removeprefix("step-"))
    assert 1 <= k < STEPS  # steps 0 .. k-1 are in the checkpoint

    resumed = subprocess.run(
        _cmd(broken, "--resume", "latest"), env=env, capture_output=True, text=True, timeout=240
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"at step {k}" in resumed.stdout

    expected = [_deterministic(r) for r in read_jsonl(whole / "metrics.jsonl")]
    got = [_deterministic(r) for r in read_jsonl(broken / "metrics.jsonl")]
    assert [r["step"] for r in got] == list(range(STEPS))  # one unbroken file
    assert got[k:] == expected[k:]  # bit-exact: float equality of every value
    assert got == expected

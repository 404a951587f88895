"""One run per directory (pipeline/runtime/watch/rundir_lock.py): a second run on a run_dir or a
checkpoint.save_dir that a live run holds fails at once, naming the holder's pid and the
directory (exit 2 from the CLI), and starts no process; a lock whose holder was killed
is taken over. Before the lock, two runs on one run_dir both started, the second's
checkpointer deleted the first's in-progress save and both appended to metrics.jsonl."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from pipeline_helpers import RecordingLauncher, interruptible

from hybridflow import cli
from hybridflow.config.schema import load_topology
from hybridflow.errors import ConfigError
from hybridflow.pipeline.runtime.runner import run_topology
from hybridflow.pipeline.runtime.watch.rundir_lock import (
    LOCK_FILE,
    DirLock,
    held_here,
    lock_dirs,
    read_holder,
)

REPO = Path(__file__).resolve().parents[2]

HOLD = """
import sys, time
from hybridflow.pipeline.runtime.watch.rundir_lock import DirLock
lock = DirLock(sys.argv[1], "run_dir", "test holder")
lock.acquire()
print("locked", flush=True)
time.sleep(600)
"""


def _wait_for_holder(directory: Path, pid: int, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        holder = read_holder(directory)
        if holder is not None and holder.pid == pid:
            return
        assert proc.poll() is None, f"the holder exited with {proc.returncode}"
        time.sleep(0.1)
    raise AssertionError(f"{pid} never took the lock of {directory}")


def test_a_second_lock_names_the_holder_and_a_released_one_is_free(tmp_path):
    first = DirLock(tmp_path / "run", "run_dir", "run 'a'")
    first.acquire()
    holder = read_holder(tmp_path / "run")
    assert holder is not None and holder.pid == os.getpid() and holder.command == "run 'a'"
    assert holder.alive() is True
    assert held_here(tmp_path / "run" / "sft") == (tmp_path / "run").resolve()
    with pytest.raises(ConfigError) as info:
        DirLock(tmp_path / "run", "run_dir", "run 'b'").acquire()
    text = str(info.value)
    assert text.startswith(f"run_dir: {str(tmp_path / 'run')!r} is in use by another run: ")
    assert f"pid {os.getpid()} on " in text and "(run 'a'), this very process" in text
    first.release()
    assert read_holder(tmp_path / "run") is None  # released: the file no longer names one
    assert held_here(tmp_path / "run") is None
    with lock_dirs([("run_dir", tmp_path / "run"), ("checkpoint.save_dir", tmp_path / "run")]):
        pass  # one directory named twice is locked once


@pytest.mark.timeout(60)
def test_a_killed_holders_lock_is_taken_over(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_for_holder(tmp_path, proc.pid, proc)
        with pytest.raises(ConfigError, match=f"in use by another run: pid {proc.pid} on "):
            DirLock(tmp_path, "run_dir", "second").acquire()
        proc.kill()
        proc.wait()
        stale = read_holder(tmp_path)
        assert stale is not None and stale.pid == proc.pid and stale.alive() is False
        with DirLock(tmp_path, "run_dir", "second"):  # the OS released the dead one's flock
            holder = read_holder(tmp_path)
            assert holder is not None and holder.pid == os.getpid()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.timeout(120)
def test_a_second_run_on_a_live_runs_run_dir_fails_fast_naming_its_pid(topo_dict, tmp_path, capsys):
    data = topo_dict(steps=10_000)  # runs until it is stopped
    data["checkpoint"] = {"save_interval": 1, "keep_last": 1}
    cfg = tmp_path / "long.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run_dir = Path(data["run_dir"])
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = (tmp_path / "first.out").open("wb")  # a pipe nobody reads could fill and block it
    first = subprocess.Popen(
        [sys.executable, "-m", "hybridflow", "run", str(cfg)],
        cwd=tmp_path,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        preexec_fn=interruptible,
    )
    try:
        _wait_for_holder(run_dir, first.pid, first)
        metrics = run_dir / "metrics.jsonl"
        for _ in range(600):  # the first run is stepping (and checkpointing)
            if metrics.exists() and metrics.read_text().count("\n") >= 1:
                break
            time.sleep(0.1)

        launcher = RecordingLauncher()
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as info:
            run_topology(load_topology(data), launcher=launcher)
        assert time.monotonic() - t0 < 10  # before any process starts
        assert launcher.started == {}
        text = str(info.value)
        assert info.value.path == "run_dir", text
        assert f"{str(run_dir)!r} is in use by another run: pid {first.pid} on " in text, text
        assert "(run 'rt')" in text, text

        # The CLI: one line, exit 2.
        assert cli.main(["run", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hybridflow: error: run_dir: ") and f"pid {first.pid}" in err

        # Another run_dir but the same checkpoint directory: refused too, by that key.
        other = dict(data, run_dir=str(tmp_path / "other"))
        other["checkpoint"] = dict(data["checkpoint"], save_dir=str(run_dir / "checkpoints"))
        with pytest.raises(ConfigError) as info:
            run_topology(load_topology(other), launcher=RecordingLauncher())
        assert info.value.path == "checkpoint.save_dir", str(info.value)
        assert f"pid {first.pid}" in str(info.value)

        assert first.poll() is None  # the first run never noticed
        lines = metrics.read_text().splitlines()
        assert all(json.loads(line)["step"] == i for i, line in enumerate(lines[:-1]))
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGTERM)
            try:
                first.wait(timeout=30)
            except subprocess.TimeoutExpired:
                first.kill()
                first.wait()
        out.close()
    assert (run_dir / LOCK_FILE).exists() and read_holder(run_dir) is None  # released


def test_an_engine_on_a_held_log_dir_is_refused_before_starting_anything(tmp_path):
    sys.path.insert(0, str(REPO / "tests" / "api"))
    try:
        from engine_job import builder
    finally:
        sys.path.remove(str(REPO / "tests" / "api"))
    with DirLock(tmp_path / "log", "run_dir", "run 'other'"):
        engine = builder().build(metrics_backend="null", log_dir=tmp_path / "log")
        with pytest.raises(ConfigError) as info:
            engine.train("last_digit", steps=1)
        assert info.value.path == "log_dir"
        assert f"pid {os.getpid()} on " in str(info.value) and "(run 'other')" in str(info.value)
        assert engine.pids() == {}
        engine.close()

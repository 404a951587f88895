"""Every wait has a bound named in its error, over real processes: a deadlocked reward
function, a task whose shared memory vanished before the stage read it, and Ctrl-C /
SIGTERM to `hybridflow run` while a driver op is busy. Each must end the run (no hang:
the pytest timeout is the only clock here) with an error naming what was stuck, and
leave no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from pipeline_helpers import (
    RecordingLauncher,
    alive,
    descendants,
    interruptible,
    leftovers,
    stage_processes,
)

from hybridflow.config.schema import load_topology
from hybridflow.errors import StageError
from hybridflow.pipeline.runtime.runner import run_topology
from hybridflow.transport import tensors

REPO = Path(__file__).resolve().parents[2]


def fast(data: dict[str, Any]) -> dict[str, Any]:
    for stage in data["stages"].values():
        for role in stage["roles"].values():
            role["options"].pop("ms_per_sample", None)
            role["options"].pop("work", None)
    return data


@pytest.mark.timeout(90)
def test_deadlocked_reward_function_ends_the_run_naming_op_step_and_setting(topo_dict):
    data = topo_dict(steps=2)
    data["stages"]["reward"]["roles"]["reward"] = {
        "backend": "function",
        "options": {
            "function": "tests.pipeline.stuck_fns:deadlocked_reward",
            "tokenizer": "builtin",
        },
    }
    data["dataflow"][1]["inputs"] = ["prompt_ids", "response_ids"]
    data["dataflow"][1]["timeout_s"] = 2.0
    launcher, run_id = RecordingLauncher(), uuid.uuid4().hex[:12]
    with pytest.raises(StageError) as info:
        run_topology(load_topology(data), run_id=run_id, launcher=launcher)
    err = info.value
    text = str(err)
    assert (err.stage, err.replica, err.step) == ("reward", 0, 0), text
    assert text.startswith("stage reward replica 0 (pid "), text
    assert "reward.score step 0 micro-batch " in text and "after it started" in text, text
    assert "`dataflow[1].timeout_s` = 2s bounds one task of this op" in text, text
    assert not leftovers(run_id, launcher.started)


@pytest.mark.timeout(90)
def test_task_whose_shared_memory_vanished_is_a_named_error(topo_dict, monkeypatch):
    """Someone removes the segment of a Task's tensors before the reward stage maps it:
    the stage cannot decode the Task, and says so instead of dropping it."""
    encode_shm = tensors.TensorCodec._encode_shm
    removed: list[str] = []

    def encode_then_remove(self, big, peer):  # type: ignore[no-untyped-def]
        descs = encode_shm(self, big, peer)
        if peer == b"reward/0":
            for name in {d.where.name for d in descs}:
                if os.path.exists(f"/dev/shm/{name}"):
                    os.unlink(f"/dev/shm/{name}")
                    removed.append(name)
        return descs

    monkeypatch.setattr(tensors.TensorCodec, "_encode_shm", encode_then_remove)
    data = fast(topo_dict(steps=2))
    data["transport"] = {"shm_threshold": 0}  # every tensor through /dev/shm
    launcher, run_id = RecordingLauncher(), uuid.uuid4().hex[:12]
    with pytest.raises(StageError) as info:
        run_topology(load_topology(data), run_id=run_id, launcher=launcher)
    err = info.value
    text = str(err)
    assert removed
    assert (err.stage, err.replica, err.step) == ("reward", 0, 0), text
    assert text.startswith("stage reward replica 0 failed in reward.score at step 0"), text
    assert "ProtocolError: the Task message could not be decoded" in text, text
    assert "does not exist" in text, text
    assert not leftovers(run_id, launcher.started)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_a_long_driver_op_exits_within_seconds(topo_dict, tmp_path, sig):
    started = tmp_path / "driver_started"
    data = fast(topo_dict(steps=3))
    data["dataflow"].insert(
        2,
        {
            "role": "driver",
            "op": "tests.pipeline.stuck_fns:long_driver_op",
            "inputs": ["rewards"],
            "outputs": ["slow_out"],
            "params": {"touch": str(started)},
        },
    )
    data["metrics"] = {"backends": ["jsonl"]}
    cfg = tmp_path / "slow.yaml"
    cfg.write_text(yaml.safe_dump(data))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cli = [sys.executable, "-m", "hybridflow", "run", str(cfg)]
    proc = subprocess.Popen(
        cli,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=interruptible,
    )
    try:
        while not started.exists():
            assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")[-3000:]
            time.sleep(0.1)
        assert len(stage_processes(proc.pid)) == 3
        stages = list(descendants(proc.pid))  # the stages, and the fork server with them
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)  # a busy compute thread must not hold the exit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (130, 143), out.decode(errors="replace")[-3000:]
    for _ in range(100):  # reaped by the coordinator's teardown; allow the kernel a moment
        if not any(alive(pid) for pid in stages):
            break
        time.sleep(0.1)
    assert not [pid for pid in stages if alive(pid)]

"""Failures over real processes: a stage killed with SIGKILL, a stage that stops
heartbeating (SIGSTOP), a role that raises, a setup that fails, a handshake with the
wrong config. Each must end the run with a clear error naming the stage, and leave no
process, shared-memory segment or ipc directory behind."""

from __future__ import annotations

import os
import re
import signal
import threading
import uuid
from typing import Any

import pytest
from pipeline_helpers import RecordingLauncher, StepSignal, leftovers

from hybridflow.config.schema import load_topology
from hybridflow.errors import PipelineError, StageDeadError, StageError
from hybridflow.pipeline.runtime.runner import run_topology


def long_run(topo_dict: Any, **run: Any) -> dict[str, Any]:
    data = topo_dict(steps=40, **run)
    data["transport"] = {"shm_threshold": 0}  # in-flight tensors sit in /dev/shm: must be swept
    for stage in data["stages"].values():
        for role in stage["roles"].values():
            role["options"]["ms_per_sample"] = 2.0
    return data


def run_and_signal(data: dict[str, Any], victim: str, sig: int) -> tuple[BaseException, str, int]:
    """Run `data`; once step 0 is done, send `sig` to the victim stage's process."""
    launcher = RecordingLauncher()
    step0 = StepSignal(at=0)
    run_id = uuid.uuid4().hex[:12]
    sent: dict[str, int] = {}

    def killer() -> None:
        if step0.event.wait(60):
            sent["pid"] = launcher.started[victim]
            os.kill(sent["pid"], sig)

    t = threading.Thread(target=killer, name="test-killer", daemon=True)
    t.start()
    with pytest.raises(PipelineError) as info:
        run_topology(load_topology(data), run_id=run_id, launcher=launcher, sinks=[step0])
    t.join(5)
    assert not leftovers(run_id, launcher.started)
    return info.value, run_id, sent["pid"]


@pytest.mark.parametrize("victim", ["rollout", "reward", "actor"])
def test_kill9_of_each_stage_is_a_named_error_and_leaves_nothing(topo_dict, victim):
    err, _, pid = run_and_signal(long_run(topo_dict), f"{victim}/0", signal.SIGKILL)
    assert isinstance(err, StageDeadError)
    assert err.stage == victim and err.replica == 0
    text = str(err)
    assert text.startswith(f"stage {victim} replica 0 (pid {pid}) was killed by SIGKILL ")
    assert re.search(r"(while running|its last task was) \w+\.\w+ step \d+", text), text
    assert err.step is not None and err.step >= 0


def test_silent_stage_hits_the_heartbeat_timeout(topo_dict):
    data = long_run(topo_dict)
    data["liveness"].update(heartbeat_timeout_s=2.0, shutdown_timeout_s=1.0)
    err, _, pid = run_and_signal(data, "reward/0", signal.SIGSTOP)
    assert isinstance(err, StageDeadError) and err.stage == "reward"
    assert re.match(
        rf"stage reward replica 0 \(pid {pid}\) sent nothing for \d+\.\ds .*; "
        r"liveness.heartbeat_timeout_s = 2.0 bounds this wait",
        str(err),
    ), str(err)


def test_raising_role_is_a_stage_error_with_the_remote_traceback(topo_dict):
    data = topo_dict(steps=3)
    data["stages"]["reward"]["roles"]["reward"]["options"]["fail_at"] = {
        "op": "score",
        "step": 1,
        "mb_id": 2,
    }
    launcher, run_id = RecordingLauncher(), uuid.uuid4().hex[:12]
    with pytest.raises(StageError) as info:
        run_topology(load_topology(data), run_id=run_id, launcher=launcher)
    err = info.value
    assert str(err).startswith(
        "stage reward replica 0 failed in reward.score at step 1 micro-batch 2: "
        "RuntimeError: synthetic failure injected at score step 1 mb 2\n--- remote traceback ---"
    )
    assert (err.stage, err.replica, err.step, err.mb_id) == ("reward", 0, 1, 2)
    assert "hybridflow/stages/synthetic.py" in err.remote_traceback
    assert "in _inject" in err.remote_traceback
    assert "stage_process.py" not in err.remote_traceback  # runtime plumbing trimmed
    assert not leftovers(run_id, launcher.started)


def test_failing_setup_is_reported_before_any_step(topo_dict):
    data = topo_dict()
    # (An option typo no longer gets this far: plan time refuses it with its key.)
    data["stages"]["actor"]["roles"]["actor"]["options"]["fail_at"] = {"op": "setup"}
    launcher, run_id = RecordingLauncher(), uuid.uuid4().hex[:12]
    with pytest.raises(
        StageError,
        match=r"^stage actor replica 0 failed during setup: RuntimeError: synthetic failure injected at setup",
    ):
        run_topology(load_topology(data), run_id=run_id, launcher=launcher)
    assert not leftovers(run_id, launcher.started)


class TamperingLauncher(RecordingLauncher):
    """Starts the reward stage with a different seed than the coordinator's config."""

    def start(self, specs):  # type: ignore[no-untyped-def]
        for spec in specs:
            if spec.name == "reward/0":
                spec.payload["topology"]["seed"] = 999
        super().start(specs)


def test_handshake_rejects_a_stage_with_another_config(topo_dict):
    launcher, run_id = TamperingLauncher(), uuid.uuid4().hex[:12]
    with pytest.raises(
        PipelineError,
        match=r"^stage reward replica 0 rejected: config hash \w+ differs from the coordinator's \w+",
    ):
        run_topology(load_topology(topo_dict()), run_id=run_id, launcher=launcher)
    assert not leftovers(run_id, launcher.started)

"""What is not an `Exception` still ends the run with a named failure, at once (issue 22):
a BaseException subclass, GeneratorExit or SystemExit raised by an op in a stage process,
a BaseException during a stage's setup, and a data source or a driver op in the
coordinator raising KeyboardInterrupt / SystemExit from their own code. Each once waited
for a deadline (a heartbeat bound, "a message was lost") or killed the process unseen;
each must be a Failure naming the stage, the op and the cause. Real processes: the
stages are launched as in a run; the coordinator cases run the CLI in a subprocess
(a KeyboardInterrupt that escaped would stop pytest itself)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import yaml
from pipeline_helpers import RecordingLauncher, leftovers

from hybridflow.config.schema import load_topology
from hybridflow.errors import StageError
from hybridflow.pipeline.runtime.runner import run_topology

REPO = Path(__file__).resolve().parents[2]


def _fast(data: dict) -> dict:
    for stage in data["stages"].values():
        for role in stage["roles"].values():
            role["options"].pop("ms_per_sample", None)
            role["options"].pop("work", None)
    return data


def _with_reward_function(data: dict, function: str) -> dict:
    data["stages"]["reward"]["roles"]["reward"] = {
        "backend": "function",
        "options": {"function": function, "tokenizer": "builtin"},
    }
    data["dataflow"][1]["inputs"] = ["prompt_ids", "response_ids"]
    # Long bounds: the failure must come from the stage's report, not from a deadline.
    data["liveness"]["heartbeat_timeout_s"] = 60.0
    return data


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("function", "error_type"),
    [
        ("abort_reward", "Abort"),
        ("generator_exit_reward", "GeneratorExit"),
        ("system_exit_reward", "SystemExit"),
    ],
)
def test_a_base_exception_from_an_op_is_a_named_failure_at_once(topo_dict, function, error_type):
    data = _with_reward_function(
        _fast(topo_dict(steps=2)), f"tests.pipeline.failing_fns:{function}"
    )
    launcher, run_id = RecordingLauncher(), uuid.uuid4().hex[:12]
    t0 = time.monotonic()
    with pytest.raises(StageError) as info:
        run_topology(load_topology(data), run_id=run_id, launcher=launcher)
    took = time.monotonic() - t0
    err = info.value
    text = str(err)
    assert (err.stage, err.replica, err.step) == ("reward", 0, 0), text
    assert text.startswith("stage reward replica 0 failed in reward.score at step 0"), text
    assert f": {error_type}: " in text.split("\n")[0], text
    assert "lost" not in text and "timeout" not in text, text
    assert took < 50, f"{took:.1f}s: the failure waited for a bound"  # heartbeat bound: 60 s
    assert not leftovers(run_id, launcher.started)


@pytest.mark.timeout(120)
def test_a_base_exception_during_setup_is_a_named_failure(topo_dict):
    data = _with_reward_function(_fast(topo_dict(steps=1)), "tests.pipeline.abort_at_setup:reward")
    launcher, run_id = RecordingLauncher(), uuid.uuid4().hex[:12]
    with pytest.raises(StageError) as info:
        run_topology(load_topology(data), run_id=run_id, launcher=launcher)
    text = str(info.value)
    first = text.split("\n")[0]
    assert first.startswith("stage reward replica 0 failed during setup: Abort: "), text
    assert "the reward module's import gave up" in first, text
    assert not leftovers(run_id, launcher.started)


# -- in the coordinator -----------------------------------------------------------------

_MAIN = textwrap.dedent(
    """
    import sys
    from hybridflow.pipeline.sources.registry import register_source
    register_source("interrupting", "tests.pipeline.failing_fns:InterruptingSource")
    from hybridflow.cli import main
    sys.exit(main(["run", sys.argv[1]]))
    """
)


def _run_cli(tmp_path: Path, data: dict) -> subprocess.CompletedProcess[str]:
    data["metrics"] = {"backends": ["jsonl"]}
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(data))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", _MAIN, str(cfg)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )


def _error_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("hybridflow: ")]
    assert lines, done.stderr[-3000:]
    return lines[-1]


@pytest.mark.timeout(120)
def test_a_data_source_raising_keyboard_interrupt_is_a_named_failure(topo_dict, tmp_path):
    data = _fast(topo_dict(steps=3))
    data["data"] = {"source": "interrupting", "fields": ["sample_idx", "prompt_ids"]}
    data["data"]["options"] = {"at": 1}
    done = _run_cli(tmp_path, data)
    line = _error_line(done)
    assert done.returncode == 2, (line, done.stderr[-3000:])
    assert line.startswith("hybridflow: error: data source 'interrupting' failed for step 1"), line
    assert "KeyboardInterrupt" in line and "own KeyboardInterrupt at step 1" in line, line


@pytest.mark.timeout(120)
def test_a_driver_op_raising_system_exit_is_a_named_failure(topo_dict, tmp_path):
    data = _fast(topo_dict(steps=2))
    data["dataflow"].insert(
        2,
        {
            "role": "driver",
            "op": "tests.pipeline.failing_fns:exiting_driver",
            "inputs": ["rewards"],
            "outputs": ["never"],
        },
    )
    done = _run_cli(tmp_path, data)
    line = _error_line(done)
    assert done.returncode == 2, (line, done.stderr[-3000:])
    assert line.startswith(
        "hybridflow: error: driver op tests.pipeline.failing_fns:exiting_driver failed at step 0"
    ), line
    assert "SystemExit: 7" in line, line


@pytest.mark.timeout(120)
def test_a_dead_work_loop_in_a_stage_is_a_named_failure_not_a_silent_queue(topo_dict):
    # The reward stage's work loop dies at its first task (its dispatcher raises): the
    # stage reports it and stops, and the run ends naming the stage and the loop, long
    # before the 60 s heartbeat bound (heartbeats would go on while tasks sit queued).
    data = _with_reward_function(
        _fast(topo_dict(steps=2)), "tests.pipeline.broken_work_loop:reward"
    )
    launcher, run_id = RecordingLauncher(), uuid.uuid4().hex[:12]
    t0 = time.monotonic()
    with pytest.raises(StageError) as info:
        run_topology(load_topology(data), run_id=run_id, launcher=launcher)
    took = time.monotonic() - t0
    err = info.value
    first = str(err).split("\n")[0]
    assert (err.stage, err.replica) == ("reward", 0), first
    assert first.startswith("stage reward replica 0 failed - its work loop died: RuntimeError: "), (
        first
    )
    assert "the dispatcher is broken" in first, first
    assert "broken_work_loop.py" in err.remote_traceback
    assert took < 50, f"{took:.1f}s: the failure waited for a bound"  # heartbeat bound: 60 s
    assert not leftovers(run_id, launcher.started)

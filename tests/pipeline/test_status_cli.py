"""`hybridflow status RUN_DIR` from another shell: while a run is stuck on a deadlocked
reward function (its default bound, 10 minutes, far away), status says the run is alive
(the lock file's pid) and who waits on whom, the run's own console shows the waiting
line once `liveness.report_interval_s` has passed, and after the run is killed -9 status
says it is not alive (exit 1) and shows its last state."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from hybridflow import cli
from hybridflow.pipeline.runtime.watch.status import describe

REPO = Path(__file__).resolve().parents[2]
AWAITED = "on stage reward replica 0 (pid "


def _children(pid: int) -> list[int]:
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(stat.split("/")[2]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _status(run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hybridflow", "status", str(run_dir)],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_status_of_a_directory_without_a_run(tmp_path, capsys):
    assert cli.main(["status", str(tmp_path)]) == 1
    assert "holds no hybridflow run" in capsys.readouterr().out
    assert cli.main(["status", str(tmp_path / "nope")]) == 2
    assert "RUN_DIR: " in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_status_names_what_a_stuck_live_run_waits_on_and_a_killed_one_is_not_alive(
    topo_dict, tmp_path
):
    data = topo_dict(steps=2)
    data["stages"]["reward"]["roles"]["reward"] = {
        "backend": "function",
        "options": {
            "function": "tests.pipeline.stuck_fns:deadlocked_reward",
            "tokenizer": "builtin",
        },
    }
    data["dataflow"][1]["inputs"] = ["prompt_ids", "response_ids"]
    data["liveness"]["report_interval_s"] = 1.0
    cfg = tmp_path / "stuck.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run_dir = Path(data["run_dir"])
    console = tmp_path / "console.txt"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    with console.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hybridflow", "run", str(cfg)],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    stages: list[int] = []
    try:
        lines: list[str] = []
        for _ in range(1500):  # until a status names the stuck reward task
            assert proc.poll() is None, console.read_text()[-3000:]
            alive, lines = describe(run_dir)
            # Once the stage's heartbeat lists the task as running (before that the line
            # says "sent, no heartbeat has listed it yet", bounded by the heartbeat).
            if any(
                AWAITED in line
                and "for reward.score step 0" in line
                and "`dataflow[1].timeout_s`" in line
                for line in lines
            ):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(lines)
        assert alive
        stages = _children(proc.pid)
        shown = _status(run_dir)  # the real command, from another process
        assert shown.returncode == 0, shown.stderr
        out = shown.stdout.splitlines()
        assert out[0].startswith("run 'rt' (run id ") and f"alive, pid {proc.pid} on " in out[0]
        assert out[1].startswith("job running: steps 0..1"), out
        stuck = [line for line in out if AWAITED in line and "for reward.score step 0" in line]
        assert stuck, out
        assert (
            "; last heartbeat " in stuck[0]
            and "; bound: `dataflow[1].timeout_s` = 600s " in (stuck[0])
        ), stuck[0]

        for _ in range(300):  # the run's console: the same line once it waited 1 s
            text = console.read_text()
            if any(
                line.split(": ", 1)[-1].startswith("waiting ") and "for reward.score step 0" in line
                for line in text.splitlines()
            ):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(console.read_text()[-3000:])
    finally:
        proc.kill()
        proc.wait()
    shown = _status(run_dir)
    assert shown.returncode == 1, shown.stdout + shown.stderr
    first = shown.stdout.splitlines()[0]
    assert f"not alive: pid {proc.pid} on " in first and "exited without releasing" in first
    assert any("for reward.score step 0" in line for line in shown.stdout.splitlines())

    # Nobody was left to clean up after a SIGKILLed coordinator: do it for this test.
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in stages) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in stages if os.path.exists(f"/proc/{p}")]
    from hybridflow.transport import shm

    run_id = describe(run_dir)[1][0].split("(run id ")[1].split(")")[0]
    shm.sweep(run_id)
    for d in glob.glob(os.path.join(tempfile.gettempdir(), f"hf-{run_id[:8]}-*")):
        shutil.rmtree(d, ignore_errors=True)

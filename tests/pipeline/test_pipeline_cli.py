"""`hybridflow validate` / `hybridflow run` as a user meets them: printed topology, exit
codes, one-line errors, and Ctrl-C (SIGINT to the launching process) with no orphans."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import yaml
from pipeline_helpers import (
    descendants,
    interruptible,
    leftovers,
    small_topology,
    stage_processes,
)

from hybridflow.cli import main


def test_validate_prints_the_resolved_topology(capsys):
    assert main(["validate", "overlap", "--set", "stages.reward.replicas=2"]) == 0
    out = capsys.readouterr().out
    assert "topology 'overlap'" in out
    assert "processes (4):" in out
    for line in ("rollout/0", "reward/0", "reward/1", "actor/0"):
        assert line in out
    assert "[3] step rollout.load_weights" not in out  # op 3 is the optimizer step
    assert "[3] step actor.optimizer_step() -> ()  on actor" in out
    assert "rollout.generate -> reward.score: response_ids" in out
    assert out.rstrip().endswith("ok")


def test_validate_json_and_colocation(tmp_path, capsys):
    data = small_topology(tmp_path)
    stages = data["stages"]
    stages["engine"] = {
        "roles": {
            "actor": stages.pop("actor")["roles"]["actor"],
            "rollout": stages.pop("rollout")["roles"]["rollout"],
        }
    }
    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["validate", str(f), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [(p["name"], sorted(p["roles"])) for p in d["processes"]] == [
        ("reward/0", ["reward"]),
        ("engine/0", ["actor", "rollout"]),
    ]
    assert d["ops"][0] == {
        "op": "rollout.generate",
        "scope": "micro_batch",
        "phase": "rollout",
        "runs_on": "engine",
        "inputs": ["sample_idx", "prompt_ids"],
        "outputs": ["response_ids"],
        "head": True,
        "sharded": False,
    }


def test_validate_shows_which_ops_run_on_every_fsdp_rank(capsys):
    assert main(["validate", "grpo", "--set", "stages.engine.replicas=2", "--json"]) == 0
    ops = {o["op"]: o["sharded"] for o in json.loads(capsys.readouterr().out)["ops"]}
    assert ops["actor.update"] and ops["actor.optimizer_step"] and ops["actor.reshard"]
    assert not ops["rollout.generate"] and not ops["reference.get_logprob"]  # copies
    assert main(["validate", "grpo", "--set", "stages.engine.replicas=2"]) == 0
    assert "actor.update(" in (out := capsys.readouterr().out) and "FSDP: every rank" in out


def test_validate_names_gpus_that_several_stage_processes_share(capsys):
    """The seed's four-GPU PPO layout packed onto one GPU: three stage processes on cuda:0
    (each with its own allocator), which validate says, and an out-of-memory failure there
    names the other stages instead of pids. Planning needs no GPU."""
    from hybridflow.config.schema import load_topology
    from hybridflow.pipeline.plan.planner import build_plan
    from hybridflow.pipeline.runtime.coordinator import oom_hint

    cfg = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "configs", "ppo-4gpu.yaml")
    one_gpu = ["stages.engine.replicas=1", "stages.engine.devices=[cuda:0]"]
    one_gpu += ["stages.critic.devices=cuda:0", "stages.reward.devices=cuda:0"]
    args = [a for o in one_gpu for a in ("--set", o)]
    assert main(["validate", cfg, *args, "--json"]) == 0
    shared = json.loads(capsys.readouterr().out)["shared_gpus"]
    assert shared == {"cuda:0": ["engine/0", "critic/0", "reward/0"]}
    assert main(["validate", cfg, *args]) == 0
    assert "shared GPU: cuda:0 hosts 3 stage processes" in capsys.readouterr().out

    plan = build_plan(load_topology(cfg, one_gpu))
    engine = next(p for p in plan.processes if p.name == "engine/0")
    hint = oom_hint(plan, engine, "OutOfMemoryError")
    assert "cuda:0 is shared with stage process(es) critic/0, reward/0" in hint
    assert oom_hint(plan, engine, "ValueError") == ""
    # the layout as written (critic and reward on GPUs of their own) shares nothing
    own = build_plan(load_topology(cfg, []))
    assert own.shared_gpus() == {} and oom_hint(own, own.processes[0], "OutOfMemoryError") == ""
    assert main(["validate", cfg, "--json"]) == 0
    assert "shared_gpus" not in json.loads(capsys.readouterr().out)


def test_a_host_needs_a_multi_host_launcher(tmp_path, capsys):
    """`hosts` naming another machine: validate shows it; `run` with the local launcher
    refuses before any process starts, naming the key."""
    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump(small_topology(tmp_path)))
    assert main(["validate", str(f), "--set", "stages.reward.hosts=node1"]) == 0
    assert "on host node1" in capsys.readouterr().out
    assert main(["run", str(f), "--set", "stages.reward.hosts=node1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "hybridflow: error: stages.reward.hosts: puts reward/0 on host 'node1': processes on "
        "other hosts need a multi-host launcher (hybridflow run --launcher ray); drop the "
        "host to run here"
    ]
    assert main(["run", str(f), "--set", "stages.reward.hosts=localhost"]) == 0


def test_bad_config_exits_2_with_one_line(tmp_path, capsys):
    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump(small_topology(tmp_path)))
    assert main(["run", str(f), "--set", "stages.reward.replicas=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hybridflow: error: stages.reward.replicas: must be >= 1, got 0"]


def _run_id(pids) -> str:
    """A fresh interpreter's command line ends `... launcher NAME RUN_ID`."""
    with open(f"/proc/{next(iter(pids))}/cmdline", "rb") as f:
        return f.read().split(b"\0")[-2].decode()


def _shm_and_ipc() -> set[str]:
    return set(glob.glob("/dev/shm/hybridflow-*")) | set(
        glob.glob(os.path.join(tempfile.gettempdir(), "hf-*-*"))
    )


# SIGINT with stage processes forked from the fork server (the default), SIGTERM with a
# fresh interpreter per stage (HYBRIDFLOW_FORKSERVER=0): both launch paths, once each.
@pytest.mark.parametrize(
    ("sig", "forked"),
    [(signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["SIGINT-forked", "SIGTERM-fresh"],
)
def test_interrupting_the_launcher_exits_130_and_leaves_nothing(tmp_path, sig, forked):
    data = small_topology(tmp_path, steps=500)
    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    metrics = tmp_path / "run" / "metrics.jsonl"
    env = dict(os.environ, HYBRIDFLOW_FORKSERVER="1" if forked else "0")
    before = _shm_and_ipc()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridflow", "run", str(f)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env=env,
        preexec_fn=interruptible,
    )
    try:
        deadline = time.monotonic() + 90
        while not (metrics.exists() and metrics.read_text().strip()):  # a step went through
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "run never got going"
            time.sleep(0.1)
        kids = stage_processes(proc.pid)
        assert sorted(kids.values()) == ["actor/0", "reward/0", "rollout/0"]
        everyone = descendants(proc.pid)
        assert ("hf-forkserver" in everyone.values()) == forked
        run_id = "" if forked else _run_id(kids)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err.decode()
    assert err.decode().strip().splitlines()[-1] == "hybridflow: interrupted"
    if run_id:
        assert not leftovers(run_id, list(kids))
    assert not [pid for pid in everyone if os.path.exists(f"/proc/{pid}")]
    assert not _shm_and_ipc() - before
    assert not os.path.exists(f"/proc/{proc.pid}")


def test_stages_die_with_a_killed_launcher(tmp_path):
    """kill -9 of the coordinator process: no teardown code runs, yet no stage survives:
    PR_SET_PDEATHSIG ties the fork server to the launcher, and each stage to the server."""
    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump(small_topology(tmp_path, steps=500), sort_keys=False))
    metrics = tmp_path / "run" / "metrics.jsonl"
    before = _shm_and_ipc()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridflow", "run", str(f)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
        env=dict(os.environ, HYBRIDFLOW_FORKSERVER="1"),
    )
    try:
        deadline = time.monotonic() + 90
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        everyone = descendants(proc.pid)
        assert len(stage_processes(proc.pid)) == 3
        assert "hf-forkserver" in everyone.values()
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in everyone) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in everyone if os.path.exists(f"/proc/{pid}")]
    # Nobody was left to clean up after a SIGKILLed coordinator: do it for this test.
    for path in _shm_and_ipc() - before:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)

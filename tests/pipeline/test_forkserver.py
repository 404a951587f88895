"""The fork server (host/forkserver.py): a forked stage process gets what a fresh
interpreter would (environment, working directory, stdout/stderr, pass_fds, exit code),
and dies with the server; the LocalLauncher falls back to fresh interpreters."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hybridflow.pipeline.host import forkserver
from hybridflow.pipeline.runtime.launcher import LocalLauncher, ProcessSpec

pytestmark = pytest.mark.skipif(not forkserver.enabled(), reason="the fork server is Linux-only")

TARGET = """
import os, sys, time
def main(payload):
    print("out", os.environ.get("HF_TEST_VAR"), os.getcwd(), flush=True)
    print("err", payload["tag"], file=sys.stderr, flush=True)
    if payload.get("fd", -1) >= 0:
        os.write(payload["fd"], b"via-" + payload["tag"].encode())
    time.sleep(payload.get("sleep", 0))
    return payload.get("code", 0)
"""


def _spec(tmp_path, name, **payload):
    (tmp_path / "fs_target.py").write_text(TARGET)
    fds = (payload["fd"],) if payload.get("fd", -1) >= 0 else ()
    return ProcessSpec(
        name,
        "fs_target:main",
        {"tag": name, **payload},
        title="hf-test-0",
        env={"PYTHONPATH": str(tmp_path), "HF_TEST_VAR": "set-by-spec"},
        pass_fds=fds,
    )


def _wait_exits(launcher, n, seconds=60.0):
    end = time.monotonic() + seconds
    while len(exits := launcher.poll()) < n:
        assert time.monotonic() < end, "children did not exit"
        time.sleep(0.05)
    return {e.name: e.exitcode for e in exits}


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "fresh"])
def test_a_child_gets_the_spec_env_cwd_output_fds_and_exit_code(tmp_path, capfd, forked):
    os.chdir(tmp_path)
    r, w = os.pipe()
    launcher = LocalLauncher(use_forkserver=forked)
    try:
        launcher.start([_spec(tmp_path, "a/0", code=3, fd=w)])
        assert _wait_exits(launcher, 1) == {"a/0": 3}
        os.close(w)
        assert os.read(r, 100) == b"via-a/0"
    finally:
        launcher.stop(5.0)
        os.close(r)
    out, err = capfd.readouterr()
    assert f"out set-by-spec {tmp_path}" in out  # this test's captured fds, not the server's
    assert "err a/0" in err


def test_stop_escalates_and_reports_the_signal(tmp_path):
    launcher = LocalLauncher(use_forkserver=True)
    launcher.start([_spec(tmp_path, "slow/0", sleep=60)])
    pid = launcher.pids()["slow/0"]
    exits = {e.name: e.exitcode for e in launcher.stop(0.2)}
    assert exits == {"slow/0": -signal.SIGTERM}
    assert not os.path.exists(f"/proc/{pid}")


def test_children_die_with_the_server_and_are_reported_killed(tmp_path):
    server = forkserver.ForkServer()
    try:
        spec = _spec(tmp_path, "orphan/0", sleep=60)
        header = {"target": spec.target, "payload": spec.payload, "parent_pid": 0, "title": ""}
        env = dict(os.environ, PYTHONPATH=str(tmp_path))
        child = server.spawn(header, env)
        assert child.poll() is None
        server._proc.kill()  # the server dies without any teardown: PDEATHSIG takes its child
        assert child.wait(30) == -signal.SIGKILL
        assert not server.alive
        with pytest.raises(forkserver.ForkServerError, match="gone"):
            server.spawn(header, env)
    finally:
        server.close()


def test_the_launcher_falls_back_to_fresh_interpreters(tmp_path, monkeypatch, caplog):
    def broken():
        raise forkserver.ForkServerError("cannot start the fork server: test")

    monkeypatch.setattr(forkserver, "shared", broken)
    launcher = LocalLauncher(use_forkserver=True)
    try:
        launcher.start([_spec(tmp_path, "b/0", code=5)])
        assert _wait_exits(launcher, 1) == {"b/0": 5}
    finally:
        launcher.stop(5.0)
    assert "starting fresh interpreters instead" in caplog.text


THREADS = """
import torch
def main(payload):
    print("threads", torch.get_num_threads(), flush=True)
    return 0
"""


def test_a_forked_child_gets_the_thread_count_of_its_environment(tmp_path, capfd):
    """OMP_NUM_THREADS is read once, when the OpenMP runtime loads: a forked child would keep
    the server's count unless it applies its own environment's."""
    (tmp_path / "fs_threads.py").write_text(THREADS)
    specs = [
        ProcessSpec(name, "fs_threads:main", {}, env={"PYTHONPATH": str(tmp_path), **env})
        for name, env in (("one/0", {"OMP_NUM_THREADS": "1"}), ("two/0", {"OMP_NUM_THREADS": "2"}))
    ]
    launcher = LocalLauncher(use_forkserver=True)
    for spec in specs:  # one at a time: their output lines stay in order
        launcher.start([spec])
        _wait_exits(launcher, len(launcher.pids()))
    launcher.stop(5.0)
    out = capfd.readouterr().out.split()
    assert out == ["threads", "1", "threads", "2"]  # whatever the server's own count is

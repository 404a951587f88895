"""Who gets into a run, and what an outsider can make it do (real processes and sockets).

- a local process that connects first as `reward/0` with the (public) config hash is
  refused and the real stage still gets in: the run completes with correct results;
- what the impostor sends after its refusal is dropped, and a shared-memory segment it
  names is neither opened nor unlinked;
- stage processes do not import from the run's working directory (`python -P`), and
  `validate` imports nothing from there unless `--allow-cwd-imports`;
- `transport.host` off loopback needs CurveZMQ (refused with its key without it) and tcp;
- ipc directories of dead coordinators are swept at the next start, live ones kept.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import pytest
import torch
import yaml
import zmq
from pipeline_helpers import RecordingLauncher, leftovers

from hybridflow.config.schema import load_topology
from hybridflow.errors import ConfigError
from hybridflow.pipeline.plan.planner import build_plan
from hybridflow.pipeline.runtime.runner import run_topology
from hybridflow.pipeline.runtime.stage_specs import ipc_dir as _ipc_dir
from hybridflow.pipeline.runtime.stage_specs import sweep_stale_ipc_dirs
from hybridflow.transport import protocol, shm
from hybridflow.transport.protocol import (
    Heartbeat,
    Hello,
    Result,
    ShmRef,
    TensorDesc,
    Welcome,
)


class _Impostor:
    """A DEALER that connects as `reward/0` before any stage exists, says Hello with the
    public config hash, then tries to feed the coordinator (a thread of the test)."""

    def __init__(self, endpoint: str, run_id: str, config_hash: str) -> None:
        self.endpoint, self.run_id, self.config_hash = endpoint, run_id, config_hash
        self.welcome: Welcome | None = None
        self.segment = ""  # a real segment of the run it names in a Result
        self.segment_survived: bool | None = None
        self.got: list[str] = []  # messages it received after the Welcome
        self.connected = threading.Event()
        self.checked = threading.Event()  # segment_survived is known
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="impostor", daemon=True)
        self.thread.start()
        assert self.connected.wait(10)

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"reward/0")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        hello = Hello(
            stage="reward", replica=0, pid=os.getpid(), roles=["reward"],
            config_hash=self.config_hash,
        )  # fmt: skip
        sock.send_multipart(protocol.encode(hello))
        self.connected.set()
        try:
            if sock.poll(30_000):
                msg, _, _ = protocol.decode(sock.recv_multipart())
                assert isinstance(msg, Welcome)
                self.welcome = msg
            # Refused, it goes on anyway: a heartbeat, and a Result naming a real segment
            # of this run (with the run's own prefix, as a stage's would be).
            writer = shm.ShmWriter(self.run_id)
            data = torch.arange(64, dtype=torch.float32)
            self.segment = writer.write([(0, memoryview(data.numpy()).cast("B"))], 256)
            desc = TensorDesc(
                name="rewards", dtype="float32", shape=[64], nbytes=256,
                where=ShmRef(name=self.segment, offset=0, segment_bytes=256),
            )  # fmt: skip
            result = Result(
                run_id=self.run_id, task_id=0, step=0, mb_id=0, policy_version=0,
                role="reward", op="score", metrics={"reward/mean": 1.0},
            )  # fmt: skip
            sock.send_multipart(protocol.encode(Heartbeat(stage="reward", replica=0, seq=1)))
            sock.send_multipart(protocol.encode(result, [desc]))
            sock.send_multipart(protocol.encode(result))  # and without tensors
            time.sleep(1.0)  # the coordinator has read them by now
            self.segment_survived = os.path.exists(f"/dev/shm/{self.segment}")
            # Unlinked before `checked` is set: the launcher's stop waits for it and then
            # sweeps the run's segments, which would race this unlink.
            os.unlink(f"/dev/shm/{self.segment}")
            self.checked.set()
            while not self.stop.is_set():  # stays connected, holding `reward/0`
                if sock.poll(100):
                    msg, _, _ = protocol.decode(sock.recv_multipart())
                    self.got.append(type(msg).__name__)
        finally:
            sock.close(0)
            ctx.term()


class _ImpostorFirst(RecordingLauncher):
    """Starts the impostor, connected, before the real stage processes."""

    def __init__(self, config_hash: str) -> None:
        super().__init__()
        self.config_hash = config_hash
        self.impostor: _Impostor | None = None

    def start(self, specs):  # type: ignore[no-untyped-def]
        payload = specs[0].payload
        self.impostor = _Impostor(payload["endpoint"], payload["run_id"], self.config_hash)
        time.sleep(0.3)  # its connection (identity `reward/0`) is registered by the ROUTER
        super().start(specs)

    def stop(self, timeout):  # type: ignore[no-untyped-def]
        # The teardown sweeps the run's shared memory after this: a run of forked stages
        # can end within the impostor's 1 s wait, so its check must come first.
        if self.impostor is not None:
            self.impostor.checked.wait(30)
        return super().stop(timeout)


@pytest.mark.parametrize("protocol_", ["ipc", "tcp"])
def test_impostor_connecting_first_as_a_stage_is_refused_and_the_run_completes(
    topo_dict, protocol_
):
    data = topo_dict(steps=2)
    data["transport"] = {"protocol": protocol_, "host": "127.0.0.1"}
    topo = load_topology(data)
    run_id = uuid.uuid4().hex[:12]
    launcher = _ImpostorFirst(build_plan(topo).config_hash)
    try:
        res = run_topology(
            topo, collect=("sample_idx", "rewards"), run_id=run_id, launcher=launcher
        )
    finally:
        if launcher.impostor is not None:
            launcher.impostor.stop.set()
            launcher.impostor.thread.join(10)
    imp = launcher.impostor
    assert imp is not None
    assert imp.welcome is not None and not imp.welcome.accepted
    assert imp.welcome.reason == "not authenticated"
    # Nothing it sent was acted on: the segment it named was not opened/unlinked, no
    # task ever went to it, and the results are the real reward stage's.
    assert imp.segment_survived is True
    assert imp.got == []
    assert [e.exitcode for e in res.exits] == [0, 0, 0]
    done = [(e.step, e.op, e.mb_id) for e in res.events if e.kind == "done"]
    assert len(done) == len(set(done)) == 2 * (3 * 8 + 3)
    for s in range(2):
        ids = torch.cat(res.collected[s]["sample_idx"])
        assert torch.equal(ids, torch.arange(16 * s, 16 * (s + 1)))
        assert torch.equal(torch.cat(res.collected[s]["rewards"]), ids.float())
    assert not leftovers(run_id, launcher.started)


def test_a_json_py_in_the_run_directory_is_not_imported_by_stages(topo_dict, tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    marker = tmp_path / "imported"
    (cwd / "json.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
    monkeypatch.chdir(cwd)
    run_id = uuid.uuid4().hex[:12]
    res = run_topology(load_topology(topo_dict(steps=1)), run_id=run_id)
    assert [e.exitcode for e in res.exits] == [0, 0, 0]
    assert not marker.exists()


def test_validate_imports_nothing_from_the_working_directory_unless_asked(topo_dict, tmp_path):
    marker = tmp_path / "imported"
    (tmp_path / "evil_ops.py").write_text(
        f"open({str(marker)!r}, 'w').write('pwned')\ndef double(inputs, params):\n"
        "    return {'twice': inputs['rewards'] * 2}, {}\n"
    )
    data = topo_dict()
    data["dataflow"].insert(
        2,
        {"role": "driver", "op": "evil_ops:double", "inputs": ["rewards"], "outputs": ["twice"]},
    )
    cfg = tmp_path / "t.yaml"
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    env = dict(os.environ)  # PYTHONPATH as given (a test harness may set it): not the cwd
    cmd = [sys.executable, "-m", "hybridflow", "validate", str(cfg)]
    refused = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert refused.returncode == 2, refused.stderr
    assert "cannot import module 'evil_ops'" in refused.stderr
    assert not marker.exists()
    allowed = subprocess.run(
        [*cmd, "--allow-cwd-imports"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert allowed.returncode == 0, allowed.stderr
    assert marker.exists()


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.7", "example.org", "::"])
def test_a_non_loopback_host_without_curve_is_refused_with_its_key(topo_dict, host, monkeypatch):
    data = topo_dict()
    data["transport"] = {"protocol": "tcp", "host": host}
    monkeypatch.setattr(zmq, "has", lambda what: what != "curve")
    with pytest.raises(ConfigError, match=r"transport\.host.*needs? CurveZMQ"):
        load_topology(data)


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.7", "example.org", "::"])
def test_a_non_loopback_host_with_curve_is_accepted_on_tcp_only(topo_dict, host):
    if not zmq.has("curve"):
        pytest.skip("this libzmq has no CurveZMQ")
    data = topo_dict()
    data["transport"] = {"protocol": "tcp", "host": host}
    assert load_topology(data).transport.host == host
    data["transport"] = {"protocol": "ipc", "host": host}
    with pytest.raises(ConfigError, match=r"transport\.protocol.*set transport\.protocol: tcp"):
        load_topology(data)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_hosts_are_accepted(topo_dict, host):
    data = topo_dict()
    data["transport"] = {"protocol": "tcp", "host": host}
    assert load_topology(data).transport.host == host


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_ipc_dirs_of_dead_coordinators_are_swept_live_ones_kept(tmp_path, topo_dict):
    base = tmp_path / "ipc"
    base.mkdir()
    dead = base / f"hf-deadbeef-p{_dead_pid()}-x1y2"
    live = base / f"hf-cafecafe-p{os.getpid()}-a1b2"
    other = base / "hf-notours"  # not this naming scheme: never touched
    for d in (dead, live, other):
        d.mkdir()
        (d / "coordinator").write_text("")
    assert sweep_stale_ipc_dirs(str(base)) == [str(dead)]
    assert not dead.exists() and live.exists() and other.exists()
    # A new session sweeps on its own, and names its directory after its own pid.
    dead.mkdir()
    data: dict[str, Any] = topo_dict()
    data["transport"] = {"ipc_dir": str(base)}
    made = _ipc_dir(load_topology(data), "run12345678")
    assert made is not None
    assert os.path.basename(made).startswith(f"hf-run12345-p{os.getpid()}-")
    assert not dead.exists() and live.exists()
    os.rmdir(made)


def _non_loopback_ip() -> str | None:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only picks the route's address
            ip = str(s.getsockname()[0])
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_off_loopback_the_coordinator_is_curve_and_strangers_get_nothing_in(topo_dict):
    """A run bound off loopback completes over CurveZMQ (keys via stdin only), while a
    plain client and a Curve client with keys of its own send to its ROUTER for nothing."""
    ip = _non_loopback_ip()
    if ip is None or not zmq.has("curve"):
        pytest.skip("no non-loopback address or no CurveZMQ here")
    data = topo_dict()
    data["transport"] = {"protocol": "tcp", "host": ip}
    topo = load_topology(data)
    strangers: list[zmq.Socket] = []

    class Prying(RecordingLauncher):
        def start(self, specs):  # type: ignore[no-untyped-def]
            endpoint = specs[0].payload["endpoint"]
            assert endpoint.startswith(f"tcp://{ip}:") and "curve" in specs[0].payload
            pub, sec = zmq.curve_keypair()
            server_public = specs[0].payload["curve"]["server_public"].encode()
            for keys in (None, (server_public, pub, sec)):
                sock = zmq.Context.instance().socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                if keys is not None:
                    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
                sock.connect(endpoint)
                with contextlib.suppress(zmq.Again):  # refused: nothing to queue on
                    sock.send_multipart([b"hello", b"x" * 64], zmq.NOBLOCK)
                strangers.append(sock)
            super().start(specs)

    run_id = uuid.uuid4().hex[:12]
    launcher = Prying()
    try:
        res = run_topology(topo, run_id=run_id, launcher=launcher)
    finally:
        for sock in strangers:
            sock.close(0)
    assert len(res.metrics) == 2
    from hybridflow.transport import curve

    assert curve.ZapGate.of(zmq.Context.instance()).refused.get(run_id, 0) >= 1
    assert not leftovers(run_id, launcher.started)

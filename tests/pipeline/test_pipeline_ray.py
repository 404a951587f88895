"""Stage processes on a Ray cluster (pipeline/runtime/ray_launcher.py), CPU only.

One local Ray cluster of two simulated nodes (`hybridflow_host:node0` / `node1`) is
shared by the module. The coordinator binds the driver's non-loopback address when the
machine has one, so these runs also go through CurveZMQ (transport/curve.py):
- a small GRPO run with the engine on node0 and the reward on node1 logs exactly the
  metrics of the local launcher at the same seed, and leaves nothing behind;
- a supervising actor SIGKILLed mid-run -> a StageDeadError naming the process and its
  host, and no process of the run is left (pids checked);
- a raw client without the run's keys gets nothing into a Curve-protected ROUTER.
Skipped without ray.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from pipeline_helpers import alive  # noqa: E402

from hybridflow import DataflowBuilder  # noqa: E402
from hybridflow.errors import StageDeadError  # noqa: E402
from hybridflow.pipeline.runtime.ray_launcher import RayLauncher  # noqa: E402

pytestmark = pytest.mark.timeout(300)

LOGIC = """
response = actor.generate(prompt, n=4)
reward_score = reward.score(prompt, response)
ref_logprob = ref.get_logprob(prompt, response)
actor_logprob = actor.get_logprob(prompt, response)
kl_div = kl(actor_logprob, ref_logprob, kind="k3")
loss = grpo_loss(reward_score, kl_div)
actor.update(loss)
"""
TIMING = ("timing/", "compute/", "perf/", "rollout/gen_s", "rollout/tokens_per_s", "reward/fn_s")
ON_NODES = {
    "actor": [("node0", "cpu")],
    "ref": [("node0", "cpu")],
    "reward": [("node1", "cpu:2")],
}


def _builder(reward_fn: str = "hybridflow.data.tasks:last_digit_reward") -> DataflowBuilder:
    df = DataflowBuilder("ray", seed=3)
    df.add_actor("tiny", device_mapping="cpu", lr=1e-2, max_new_tokens=3)
    df.add_reference_model("tiny")
    df.add_reward_function(reward_fn)
    df.define_training_step(["prompt"], ["loss", "kl_div", "rewards"], LOGIC)
    df.configure(step_batch=16, micro_batch=8)
    return df


def _clean(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def _placed_on(launcher: RayLauncher) -> dict[str, str]:
    """Process name -> the `hybridflow_host:` name of the node its Ray actor runs on."""
    names = {
        n["NodeID"]: next(r.split(":", 1)[1] for r in n["Resources"] if "hybridflow_host" in r)
        for n in ray.nodes()
        if n["Alive"]
    }
    get_node = ray.get_runtime_context
    return {
        name: names[ray.get(p.actor.__ray_call__.remote(lambda _: get_node().get_node_id()))]
        for name, p in launcher._procs.items()
    }


def _driver_ip() -> str:
    ip = ray.util.get_node_ip_address()
    return ip if ip and not ip.startswith("127.") else "127.0.0.1"


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    c = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"hybridflow_host:node0": 1000}},
    )
    c.add_node(num_cpus=2, resources={"hybridflow_host:node1": 1000})
    ray.init(address=c.address, log_to_driver=False, include_dashboard=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _launcher() -> RayLauncher:
    return RayLauncher(bind_host=_driver_ip())


def test_grpo_on_two_nodes_matches_the_local_launcher(cluster, tmp_path, monkeypatch):
    # Ray gives its workers (and so their children) one OpenMP thread; so does the local
    # run here, as the float sums depend on the thread count.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    launcher = _launcher()
    with _builder().build(
        metrics_backend="null", log_dir=tmp_path / "ray", device_mapping=ON_NODES, launcher=launcher
    ) as engine:
        topo = engine._declared().topology
        assert topo.transport.protocol == "tcp" and topo.transport.host == _driver_ip()
        on_ray = engine.train("last_digit", steps=3)
        hosts = launcher.hosts()
        pids = dict(launcher.pids())
    assert sorted(hosts) == ["engine/0", "reward/0"]
    assert not [p for p in pids.values() if alive(p)]
    with _builder().build(
        metrics_backend="null", log_dir=tmp_path / "local", device_mapping={"reward": "cpu:2"}
    ) as engine:
        local = engine.train("last_digit", steps=3)
    a, b = _clean(on_ray.metrics), _clean(local.metrics)
    diff = [(i, k, r[k], b[i].get(k)) for i, r in enumerate(a) for k in r if r[k] != b[i].get(k)]
    assert a == b, diff
    assert len(on_ray.metrics) == 3


def test_fsdp_ranks_on_two_nodes_match_the_local_launcher(cluster, tmp_path, monkeypatch):
    """A replicated engine stage (the actor's FSDP ranks, gloo on CPU) with rank 0 on node0
    and rank 1 on node1: they meet at the TCPStore rank 0's supervisor bound on node0, and
    the run equals the same two ranks started by the local launcher."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    two = [("node0", "cpu"), ("node1", "cpu")]
    mapping = {"actor": two, "ref": two, "reward": [("node1", "cpu:2")]}
    launcher = _launcher()
    with _builder().build(
        metrics_backend="null", log_dir=tmp_path / "ray", device_mapping=mapping, launcher=launcher
    ) as engine:
        topo = engine._declared().topology
        assert topo.stages["engine"].replicas == 2
        assert topo.stages["engine"].hosts == ["node0", "node1"]
        on_ray = engine.train("last_digit", steps=3)
        assert _placed_on(launcher) == {
            "engine/0": "node0",
            "engine/1": "node1",
            "reward/0": "node1",
        }
    local_map = {"actor": ["cpu", "cpu"], "ref": ["cpu", "cpu"], "reward": "cpu:2"}
    with _builder().build(
        metrics_backend="null", log_dir=tmp_path / "local", device_mapping=local_map
    ) as engine:
        assert engine._declared().topology.stages["engine"].replicas == 2
        local = engine.train("last_digit", steps=3)
    a, b = _clean(on_ray.metrics), _clean(local.metrics)
    diff = [(i, k, r[k], b[i].get(k)) for i, r in enumerate(a) for k in r if r[k] != b[i].get(k)]
    assert a == b, diff
    assert len(on_ray.metrics) == 3


def test_a_killed_actor_is_a_stage_dead_error_and_nothing_is_left(cluster, tmp_path):
    launcher = _launcher()
    seen: dict[str, int] = {}

    def kill_reward_actor() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "reward/0" not in launcher.pids():
            time.sleep(0.05)
        seen.update(launcher.pids())
        proc = launcher._procs["reward/0"]
        actor_pid = ray.get(proc.actor.__ray_call__.remote(lambda self: os.getpid()))
        seen["actor"] = actor_pid
        time.sleep(1.0)
        os.kill(actor_pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_reward_actor, daemon=True)
    engine = _builder().build(
        metrics_backend="null", log_dir=tmp_path, device_mapping=ON_NODES, launcher=launcher
    )
    killer.start()
    with pytest.raises(
        StageDeadError,
        match=r"stage reward replica 0 .*(was lost with its Ray actor.* on host |sent nothing)",
    ):
        engine.train("last_digit", steps=200)
    killer.join(5)
    engine.close()
    assert seen, "the run never started"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [p for p in seen.values() if alive(p)]:
        time.sleep(0.1)
    assert not [p for p in seen.values() if alive(p)], seen


def test_the_cli_takes_the_ray_launcher(cluster, tmp_path, monkeypatch, capsys):
    """`hybridflow run --launcher ray` with the YAML's `hosts`: the engine on node0, the
    reward on node1, as the launcher reports where each process ran."""
    from hybridflow.cli import main

    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    seen: dict[str, dict[str, str]] = {}
    stop = RayLauncher.stop

    def spy_stop(self: RayLauncher, timeout: float) -> Any:
        seen["hosts"] = _placed_on(self)  # before teardown
        return stop(self, timeout)

    monkeypatch.setattr(RayLauncher, "stop", spy_stop)
    code = main(
        [
            "run",
            "grpo",
            "--launcher",
            "ray",
            "--set",
            f"run_dir={tmp_path}",
            "--set",
            "run.steps=1",
            "--set",
            "run.step_batch=16",
            "--set",
            "run.micro_batch=8",
            "--set",
            "metrics.backends=[jsonl]",
            "--set",
            "stages.engine.hosts=node0",
            "--set",
            "stages.reward.hosts=node1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ray launcher: transport tcp" in out and "1 step(s)" in out
    assert Path(tmp_path, "metrics.jsonl").exists()
    assert seen["hosts"] == {"engine/0": "node0", "reward/0": "node1"}


def test_weight_links_are_refused_before_any_actor_starts():
    """The listening socket of a stage-to-stage weight link is bound on the driver's host
    and inherited by the sender: the Ray launcher refuses it instead of hanging."""
    from hybridflow.errors import PipelineError
    from hybridflow.pipeline.runtime.launcher import LAUNCHER_RENDEZVOUS, ProcessSpec
    from hybridflow.pipeline.runtime.ray_launcher import _check

    base = {"endpoint": "tcp://10.0.0.1:5555", "stage": "engine", "replica": 0}
    _check(ProcessSpec("engine/0", "m:f", {**base, "init_method": LAUNCHER_RENDEZVOUS}))
    with pytest.raises(PipelineError, match="does not support stage-to-stage weight links"):
        _check(ProcessSpec("engine/0", "m:f", base, pass_fds=(7,)))
    with pytest.raises(PipelineError, match="does not support stage-to-stage weight links"):
        _check(ProcessSpec("engine/0", "m:f", {**base, "init_method": "tcp://10.0.0.1:1"}))

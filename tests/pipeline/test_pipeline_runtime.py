"""End-to-end runs over real stage processes and real ZeroMQ sockets (synthetic roles).

Checked on what actually happened: the coordinator's event log, the outputs collected,
and the synthetic actor's own order check (it raises if `update` ever sees samples out of
order, which would fail the run)."""

from __future__ import annotations

import json
import uuid

import torch
from pipeline_helpers import RecordingLauncher, leftovers

from hybridflow.config.schema import load_topology
from hybridflow.pipeline.runtime.runner import run_topology


def test_three_stages_stream_every_micro_batch_once_in_order(topo_dict, tmp_path):
    data = topo_dict(steps=3)
    data["transport"] = {"shm_threshold": 0}  # every tensor through /dev/shm: exercise that tier
    topo = load_topology(data)
    run_id = uuid.uuid4().hex[:12]
    launcher = RecordingLauncher()
    res = run_topology(topo, collect=("sample_idx", "rewards"), run_id=run_id, launcher=launcher)

    assert [e.exitcode for e in res.exits] == [0, 0, 0]
    done = [(e.step, e.op, e.mb_id) for e in res.events if e.kind == "done"]
    assert len(done) == len(set(done)) == 3 * (3 * 8 + 3)  # every task answered exactly once
    for s in range(3):
        ids = torch.cat(res.collected[s]["sample_idx"])
        assert torch.equal(ids, torch.arange(16 * s, 16 * (s + 1)))
        assert torch.equal(torch.cat(res.collected[s]["rewards"]), ids.float())
    # k = 0: no rollout of step s+1 before the weights of step s were loaded
    loaded = {e.step: i for i, e in enumerate(res.events) if e.kind == "done" and e.op == 5}
    for i, e in enumerate(res.events):
        if e.kind == "dispatch" and e.op == 0:
            assert e.policy_version == e.step
            assert e.step == 0 or i > loaded[e.step - 1]
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("timing/rollout", "timing/reward", "timing/train", "timing/reshard", "timing/step"):
        assert rows[0][key] > 0
    assert rows[0]["reward/rows"] == 2.0
    assert not leftovers(run_id, launcher.started)


def test_colocated_replicated_off_policy_with_a_driver_op(topo_dict):
    data = topo_dict(steps=4, max_offpolicy_steps=1)
    stages = data["stages"]
    # hybrid engine: actor and rollout in one process; reward scaled to two replicas
    stages["engine"] = {
        "roles": {
            "actor": stages.pop("actor")["roles"]["actor"],
            "rollout": stages.pop("rollout")["roles"]["rollout"],
        }
    }
    stages["reward"]["replicas"] = 2
    stages["reward"]["roles"]["reward"]["options"]["ms_per_sample"] = 4.0
    # a driver op (computed in the coordinator process) between scoring and training
    data["dataflow"].insert(
        2,
        {"role": "driver", "op": "identity", "inputs": ["rewards"], "outputs": ["rewards_out"]},
    )
    data["dataflow"][3]["inputs"] = ["sample_idx", "response_ids", "rewards_out"]
    data["transport"] = {"protocol": "tcp"}  # loopback TCP instead of ipc
    topo = load_topology(data)
    run_id = uuid.uuid4().hex[:12]
    launcher = RecordingLauncher()
    res = run_topology(topo, collect=("rewards_out",), run_id=run_id, launcher=launcher)

    assert sorted(launcher.started) == ["engine/0", "reward/0", "reward/1"]
    heads = [e for e in res.events if e.kind == "dispatch" and e.op == 0]
    assert all(e.policy_version >= e.step - 1 for e in heads)
    replicas = {e.replica for e in res.events if e.kind == "done" and e.op == 1}
    assert replicas == {0, 1}
    for s in range(4):
        got = torch.cat(res.collected[s]["rewards_out"])
        assert torch.equal(got, torch.arange(16 * s, 16 * (s + 1)).float())
    assert [m["policy_version"] >= m["step"] - 1 for m in res.metrics] == [True] * 4
    assert not leftovers(run_id, launcher.started)

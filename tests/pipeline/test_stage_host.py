"""The stage host's own bounds, without processes: the launch spec it decodes and its
bounded task queue (the real-process checks are in test_failures_base_exceptions.py and
test_pipeline_liveness.py)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from hybridflow.config.loader import to_dict
from hybridflow.config.schema import load_topology
from hybridflow.errors import PipelineError
from hybridflow.pipeline.host import launch_spec
from hybridflow.pipeline.host.stage_process import StageProcess
from hybridflow.transport.channel import Received
from hybridflow.transport.protocol import Task


def _payload(topo, tmp_path) -> dict:
    return {
        "topology": to_dict(topo),
        "stage": "reward",
        "replica": 0,
        "endpoint": "ipc:///nonexistent",
        "run_id": "r0",
        "run_dir": str(tmp_path),
        "parent_pid": 1,
        "secret": "ab" * 16,
    }


def test_the_launch_spec_takes_the_secret_out_and_names_a_bad_field(topo_dict, tmp_path):
    topo = load_topology(topo_dict())
    payload = _payload(topo, tmp_path)
    spec, secret = launch_spec.decode(payload)
    assert secret == bytes.fromhex("ab" * 16) and "secret" in payload  # the caller's dict kept
    assert (spec.stage, spec.replica, spec.init_listen_fd, spec.resume_dir) == ("reward", 0, -1, "")
    assert not hasattr(spec, "secret")
    with pytest.raises(msgspec.ValidationError, match=r"\$\.replica"):
        launch_spec.decode({**payload, "replica": "zero"})
    with pytest.raises(msgspec.ValidationError, match="unknown field `replicas`"):
        launch_spec.decode({**payload, "replicas": 2})


def test_the_task_queue_holds_max_inflight_tasks_and_a_control_call_then_refuses(
    topo_dict, tmp_path
):
    topo = load_topology(topo_dict())
    assert topo.run.max_inflight == 2
    spec, secret = launch_spec.decode(_payload(topo, tmp_path))

    def task(i: int) -> Received:
        return Received(
            Task(run_id="r0", task_id=i, step=0, mb_id=i, policy_version=0, role="reward", op="score")
        )  # fmt: skip

    async def fill() -> StageProcess:
        proc = StageProcess(spec, topo, secret)
        for i in range(3):  # max_inflight tasks, and the slot of the one control call
            proc._enqueue(task(i))
        with pytest.raises(PipelineError, match=r"more than run.max_inflight=2 tasks"):
            proc._enqueue(task(3))
        return proc

    proc = asyncio.run(fill())
    assert proc.worker.progress()[1] == [0, 1, 2]  # held, not started; the refused one is not
    proc.worker.shutdown()

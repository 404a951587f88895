"""The stage host's own bounds, without processes: the launch spec it decodes, its
bounded task queue, the outputs a Result carries (the real-process checks are in
test_failures_base_exceptions.py and test_pipeline_liveness.py)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from hybridflow.config.loader import to_dict
from hybridflow.config.schema import load_topology
from hybridflow.errors import PipelineError
from hybridflow.pipeline.host import launch_spec
from hybridflow.pipeline.host.stage_process import StageProcess
from hybridflow.pipeline.host.tasks import TaskRunner
from hybridflow.pipeline.observe.samples import pick_rows
from hybridflow.pipeline.plan.planner import build_plan
from hybridflow.pipeline.runtime.scheduler import Scheduler
from hybridflow.pipeline.sources.registry import create_source
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


def test_a_result_carries_only_the_outputs_its_task_names():
    out = {n: torch.zeros(2, 3) for n in ("response_ids", "response_mask", "prompt_ids", "scratch")}

    def task(returns: list[str] | None) -> Task:
        return Task(
            run_id="r", task_id=0, step=0, mb_id=0, policy_version=0, role="rollout",
            op="generate", returns=returns,
        )  # fmt: skip

    named = TaskRunner._returned(task(["response_ids", "response_mask"]), out)
    assert sorted(named) == ["response_ids", "response_mask"]  # `scratch` stays in the stage
    assert sorted(TaskRunner._returned(task(None), out)) == sorted(out)  # None: everything


def test_the_scheduler_asks_for_the_sample_fields_only_where_rows_are_sampled():
    topo = load_topology("grpo")
    plan = build_plan(topo)
    sched = Scheduler(plan)
    sched.sample_rows = 2
    source = create_source(topo.data, topo.seed)
    for step in sched.data_requests():
        sched.add_data(step, source.batch(step, topo.run.step_batch))
    generate = [d for d in sched.ready() if d.op.cfg.op == "generate"]
    picked = {d.mb_id: d.returns() for d in generate}
    assert picked, "generate dispatched"
    for mb, names in picked.items():
        assert names[:3] == ["response_ids", "response_mask", "rollout_logprobs"]
        assert ("prompt_ids" in names) == (mb in {m for m, _ in pick_rows(32, 4, 2)}), (mb, names)

"""Scheduler ordering rules, without processes: the real Scheduler and the real synthetic
role, with a simulated cluster that completes queued tasks in a seeded random order
(FIFO per replica, as a stage process does). Every rule of pipeline/runtime/scheduler.py is
checked on the event log of many interleavings."""

from __future__ import annotations

import itertools
import random
from collections import deque
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.config.dataflow import gang_params
from hybridflow.config.schema import load_topology
from hybridflow.errors import PipelineError, StageError
from hybridflow.pipeline.driver.registry import resolve_driver_op
from hybridflow.pipeline.observe.metrics import is_counter, reduce_step_metric
from hybridflow.pipeline.plan.planner import Plan, build_plan
from hybridflow.pipeline.runtime.scheduler import DRIVER_REPLICA, Scheduler, concat_rows
from hybridflow.pipeline.sources.registry import create_source
from hybridflow.stages.base import StageContext, StageWorld
from hybridflow.stages.synthetic import SyntheticRole

SYN = {"backend": "synthetic", "options": {"expect_ordered": ["update"]}}


def topology(**run: Any) -> dict[str, Any]:
    return {
        "name": "sched",
        "run": {"steps": 4, "step_batch": 8, "micro_batch": 2, "max_inflight": 2, **run},
        "data": {"fields": ["sample_idx", "prompt_ids"]},
        "stages": {
            "rollout": {"roles": {"rollout": {"backend": "synthetic"}}, "replicas": 2},
            "reward": {"roles": {"reward": {"backend": "synthetic"}}, "replicas": 2},
            "actor": {"roles": {"actor": SYN}},
        },
        "dataflow": [
            {
                "role": "rollout",
                "op": "generate",
                "inputs": ["sample_idx", "prompt_ids"],
                "outputs": ["response_ids"],
                "phase": "rollout",
            },
            {
                "role": "reward",
                "op": "score",
                "inputs": ["sample_idx", "response_ids"],
                "outputs": ["rewards"],
                "phase": "reward",
            },
            {
                "role": "driver",
                "op": "identity",
                "inputs": ["rewards"],
                "outputs": ["rewards_out"],
                "phase": "adv",
            },
            {
                "role": "actor",
                "op": "update",
                "inputs": ["sample_idx", "response_ids", "rewards_out"],
                "phase": "train",
            },
            {"role": "actor", "op": "optimizer_step", "scope": "step", "phase": "train"},
            {
                "role": "actor",
                "op": "reshard",
                "scope": "step",
                "outputs": ["weights"],
                "phase": "reshard",
            },
            {
                "role": "rollout",
                "op": "load_weights",
                "scope": "step",
                "inputs": ["weights"],
                "phase": "reshard",
            },
        ],
        "metrics": {"backends": ["memory"]},
    }


class Cluster:
    """Runs dispatches with in-process synthetic roles; completes them in random order."""

    def __init__(self, plan: Plan, seed: int) -> None:
        self.plan = plan
        self.rng = random.Random(seed)
        self.queues: dict[tuple[str, int], deque[Any]] = {}
        self.roles: dict[str, SyntheticRole] = {}
        for stage, cfg in plan.topology.stages.items():
            for r in range(cfg.replicas):
                self.queues[(stage, r)] = deque()
            for name, rc in cfg.roles.items():
                role = SyntheticRole()
                role.setup(
                    StageContext(
                        stage=stage,
                        replica=0,
                        device=torch.device("cpu"),
                        seed=0,
                        run_dir=Path("."),
                        options=dict(rc.options),
                        world=StageWorld(role=name, dataflow=plan.role_ops(name)),
                    )
                )
                self.roles[name] = role
        self.queues[("driver", DRIVER_REPLICA)] = deque()

    def run(self, sched: Scheduler, max_iters: int = 100_000) -> None:
        source = create_source(self.plan.topology.data, 0)
        pending_data: list[int] = []
        for _ in range(max_iters):
            if sched.done:
                return
            pending_data += sched.data_requests()
            if pending_data and self.rng.random() < 0.5:  # data arrives late, sometimes
                s = pending_data.pop(0)
                sched.add_data(s, source.batch(s, self.plan.topology.run.step_batch))
            for d in sched.ready():
                for stage, r in self._targets(d):
                    self.queues[(stage, r)].append(d)
                    if stage != "driver":
                        assert sched.inflight[stage][r] <= self.plan.topology.run.max_inflight
            busy = [k for k, q in self.queues.items() if q]
            if not busy:
                continue
            stage, r = self.rng.choice(busy)
            d = self.queues[(stage, r)].popleft()
            params = {"step": d.step, "mb_id": d.mb_id, "policy_version": d.policy_version}
            if stage == "driver":
                out, metrics = resolve_driver_op(d.op.cfg.op, "")(d.inputs, params)
            else:
                out, metrics = self.roles[d.op.cfg.role].handle(d.op.cfg.op, d.inputs, params)
            sched.complete(d.task_id, r, out, metrics, 0.001)
        raise AssertionError("simulation did not finish")

    @staticmethod
    def _targets(d: Any) -> list[tuple[str, int]]:
        if d.op.stage is None:
            return [("driver", DRIVER_REPLICA)]
        return [(d.op.stage, r) for r in d.replicas]


def simulate(seed: int = 0, collect: tuple[str, ...] = (), **run: Any) -> tuple[Plan, Scheduler]:
    plan = build_plan(load_topology(topology(**run)))
    clock = itertools.count()
    sched = Scheduler(plan, clock=lambda: float(next(clock)))
    sched.collect = collect
    Cluster(plan, seed).run(sched)
    return plan, sched


SEEDS = range(6)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_micro_batch_once_and_in_order(seed):
    plan, sched = simulate(seed, collect=("sample_idx", "rewards", "rewards_out"))
    dispatched = [(e.step, e.op, e.mb_id) for e in sched.events if e.kind == "dispatch"]
    assert len(dispatched) == len(set(dispatched))
    n_mb, steps = plan.topology.run.micro_batches, plan.topology.run.steps
    for op in plan.ops:
        got = [(s, m) for s, j, m in dispatched if j == op.index]
        want = (
            [(s, -1) for s in range(steps)]
            if op.is_step
            else [(s, m) for s in range(steps) for m in range(n_mb)]
        )
        assert got == want, op.label  # exactly once, in (step, mb) order
    for s in range(steps):
        ids = torch.cat(sched.collected[s]["sample_idx"])
        assert torch.equal(ids, torch.arange(s * 8, (s + 1) * 8))
        assert torch.equal(torch.cat(sched.collected[s]["rewards_out"]), ids.float())


@pytest.mark.parametrize("seed", SEEDS)
def test_k0_no_rollout_before_previous_reshard(seed):
    _, sched = simulate(seed, max_offpolicy_steps=0)
    finish = {e.step: i for i, e in enumerate(sched.events) if e.kind == "finish"}
    load_done = {e.step: i for i, e in enumerate(sched.events) if e.kind == "done" and e.op == 6}
    for i, e in enumerate(sched.events):
        if e.kind == "dispatch" and e.op == 0 and e.step > 0:
            assert i > load_done[e.step - 1] and i > finish[e.step - 1]
            assert e.policy_version == e.step


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("seed", SEEDS)
def test_k_bounds_how_far_rollout_runs_ahead(k, seed):
    _, sched = simulate(seed, max_offpolicy_steps=k, steps=6)
    finish = {e.step: i for i, e in enumerate(sched.events) if e.kind == "finish"}
    ahead = 0
    for i, e in enumerate(sched.events):
        if e.kind == "dispatch" and e.op == 0:
            assert e.policy_version >= e.step - k  # at most k versions behind
            if e.step - k - 1 >= 0:
                assert i > finish[e.step - k - 1]
            ahead = max(ahead, e.step - e.policy_version)
    assert ahead >= 1  # and it does run ahead (else k would buy nothing)


@pytest.mark.parametrize("seed", SEEDS)
def test_train_waits_for_previous_optimizer_step_even_off_policy(seed):
    _, sched = simulate(seed, max_offpolicy_steps=2, steps=5)
    done = {
        (e.step, e.op): i for i, e in enumerate(sched.events) if e.kind == "done" and e.mb_id == -1
    }
    for i, e in enumerate(sched.events):
        if e.kind == "dispatch" and e.op == 3 and e.step > 0:  # actor.update
            assert i > done[(e.step - 1, 4)] and i > done[(e.step - 1, 5)]


@pytest.mark.parametrize("seed", SEEDS)
def test_sequential_mode_is_a_phase_barrier(seed):
    plan, sched = simulate(seed, mode="sequential")
    phase = {op.index: op.phase_index for op in plan.ops}
    last_done: dict[tuple[int, int], int] = {}
    for i, e in enumerate(sched.events):
        if e.kind == "done":
            last_done[(e.step, phase[e.op])] = i
    for i, e in enumerate(sched.events):
        if e.kind == "dispatch":
            for p in range(phase[e.op]):
                assert last_done[(e.step, p)] < i


@pytest.mark.parametrize("seed", SEEDS)
def test_streamed_mode_overlaps_phases(seed):
    # 8 micro-batches, 4 rollout slots (2 replicas x max_inflight 2): scoring must start
    # while rollout of the step is still going.
    _, sched = simulate(seed, step_batch=16, steps=2)
    first_score = next(i for i, e in enumerate(sched.events) if e.kind == "dispatch" and e.op == 1)
    last_rollout = max(
        i for i, e in enumerate(sched.events) if e.kind == "done" and e.op == 0 and e.step == 0
    )
    assert first_score < last_rollout


def test_balance_and_broadcast():
    _, sched = simulate(0)
    per_replica = {0: 0, 1: 0}
    for e in sched.events:
        if e.kind == "dispatch" and e.op == 1:
            per_replica[e.replica] += 1
    assert per_replica[0] > 0 and per_replica[1] > 0
    first = next(e for e in sched.events if e.kind == "dispatch" and e.op == 0)
    assert first.replica == 0  # deterministic tie-break: lowest index
    loads = [e for e in sched.events if e.kind == "done" and e.op == 6 and e.step == 0]
    assert sorted(e.replica for e in loads) == [0, 1]  # step ops go to every replica


def test_step_values_concatenate_and_split_back():
    data = topology(steps=2)
    data["dataflow"][2]["scope"] = "step"  # identity over the whole step, sliced per mb after
    data["dataflow"][2]["phase"] = "adv"
    plan = build_plan(load_topology(data))
    assert plan.ops[3].deps == (0, 2)  # update waits for the step-level value
    clock = itertools.count()
    sched = Scheduler(plan, clock=lambda: float(next(clock)))
    sched.collect = ("rewards_out", "sample_idx")
    Cluster(plan, 3).run(sched)
    got = sched.collected[1]
    assert torch.equal(got["rewards_out"][0], torch.arange(8, 16).float())


def _drive_by_hand(plan: Plan, answer: Any) -> dict[int, Any]:
    """One step, completed in dispatch order: driver ops run, stage ops return
    `answer(dispatch)`. -> micro-batch -> the inputs actor.update received."""
    sched = Scheduler(plan)
    sched.data_requests()
    sched.add_data(0, create_source(plan.topology.data, 0).batch(0, 8))
    seen: dict[int, Any] = {}
    while not sched.done:
        ready = sched.ready()
        assert ready, "stalled"
        for d in ready:
            params = {"step": d.step, "mb_id": d.mb_id, "policy_version": 0}
            if d.op.stage is None:
                out, _ = resolve_driver_op(d.op.cfg.op, "")(d.inputs, params)
                sched.complete(d.task_id, DRIVER_REPLICA, out, {})
                continue
            if d.op.label == "actor.update":
                seen[d.mb_id] = d.inputs
            for r in d.replicas:
                sched.complete(d.task_id, r, answer(d), {})
    return seen


def _ragged(widths: list[int], other: list[int]) -> Any:
    def answer(d: Any) -> dict[str, torch.Tensor]:
        if d.op.label == "rollout.generate":
            return {"response_ids": torch.full((2, widths[d.mb_id]), d.mb_id + 1)}
        if d.op.label == "reward.score":
            return {"rewards": torch.zeros(2), "other": torch.zeros(2, other[d.mb_id])}
        return {"weights": torch.zeros(1)} if d.op.label == "actor.reshard" else {}

    return answer


def _step_identity(*inputs: str) -> Plan:
    data = topology(steps=1)
    data["dataflow"][1]["outputs"] = ["rewards", "other"]
    outs = [f"{n}_out" for n in inputs]
    data["dataflow"][2] |= {"scope": "step", "inputs": list(inputs), "outputs": outs}
    data["dataflow"][3]["inputs"] = ["sample_idx", "response_ids", *outs]
    return build_plan(load_topology(data))


def test_step_values_of_ragged_micro_batches_are_cut_back_to_each_widths():
    """A step op over responses of different widths per micro-batch gets them padded to
    the widest (concat_rows); what it returns in that padded shape goes back to each
    micro-batch at that micro-batch's own width, so it lines up with its masks (a
    step-wide advantage op feeding per-micro-batch training)."""
    widths = [3, 5, 4, 2]
    seen = _drive_by_hand(_step_identity("response_ids"), _ragged(widths, [1] * 4))
    for m, w in enumerate(widths):
        assert seen[m]["response_ids_out"].shape == (2, w)
        assert torch.equal(seen[m]["response_ids_out"], seen[m]["response_ids"])
    # two ragged inputs of different padded widths: each output goes back by its own
    other = [6, 1, 2, 3]
    seen = _drive_by_hand(_step_identity("response_ids", "other"), _ragged(widths, other))
    for m in range(4):
        assert seen[m]["response_ids_out"].shape == (2, widths[m])
        assert seen[m]["other_out"].shape == (2, other[m])


def test_ragged_step_values_that_could_go_back_two_ways_are_refused():
    """Two inputs padded to the same width but ragged differently: the cut is ambiguous."""
    plan = _step_identity("response_ids", "other")
    with pytest.raises(PipelineError, match=r"padded shape \[5\] of two of its inputs"):
        _drive_by_hand(plan, _ragged([3, 5, 4, 2], [5, 1, 2, 3]))


def test_missing_output_is_a_stage_error():
    plan = build_plan(load_topology(topology(steps=1)))
    sched = Scheduler(plan)
    sched.data_requests()
    sched.add_data(0, create_source(plan.topology.data, 0).batch(0, 8))
    d = sched.ready()[0]
    with pytest.raises(
        StageError,
        match=r"rollout.generate \(step 0, micro-batch 0\) returned \['wrong'\]; .* missing \['response_ids'\]",
    ):
        sched.complete(d.task_id, d.replicas[0], {"wrong": torch.zeros(2)}, {})


def test_bad_data_batch_is_rejected():
    plan = build_plan(load_topology(topology(steps=1)))
    sched = Scheduler(plan)
    with pytest.raises(
        PipelineError, match=r"fields \['prompt_ids'\] for step 0; data.fields says"
    ):
        sched.add_data(0, {"prompt_ids": torch.zeros(8, 3)})
    with pytest.raises(
        PipelineError, match=r"'sample_idx' has shape \[4\] for step 0; expected 8 rows"
    ):
        sched.add_data(0, {"prompt_ids": torch.zeros(8, 3), "sample_idx": torch.zeros(4)})


def test_concat_rows_pads_ragged_trailing_dims():
    a, b = torch.ones(2, 3, dtype=torch.int64), torch.full((1, 5), 2)
    out = concat_rows([a, b])
    assert out.shape == (3, 5)
    assert out[:2, 3:].eq(0).all() and out[2].eq(2).all() and out[:2, :3].eq(1).all()


def test_counters_are_summed_over_the_step_the_rest_averaged():
    """4 micro-batches of 2 samples, each falling back: 8 failures (not 2), latency mean."""
    plan = build_plan(load_topology(topology(steps=1)))
    sched = Scheduler(plan)
    cluster = Cluster(plan, seed=0)
    handle = cluster.roles["reward"].handle

    def with_counters(op: str, batch: Any, params: Any) -> Any:
        out, metrics = handle(op, batch, params)
        extra = {
            "reward/service_failures": float(len(batch["sample_idx"])),
            "reward/service_requests": 1.0,
            "rollout/tokens": 10.0,
            "reward/service_latency_ms": 10.0 + params["mb_id"],
            "rollout/tokens_per_s": 100.0,
        }
        return out, {**metrics, **extra}

    cluster.roles["reward"].handle = with_counters  # type: ignore[method-assign]
    cluster.run(sched)
    ((step, metrics),) = sched.pop_finished()
    assert step == 0
    assert metrics["reward/service_failures"] == 8.0
    assert metrics["reward/service_requests"] == 4.0
    assert metrics["rollout/tokens"] == 40.0
    assert metrics["reward/service_latency_ms"] == 11.5
    assert metrics["rollout/tokens_per_s"] == 100.0


@pytest.mark.parametrize(
    ("key", "summed"),
    [
        ("reward/service_failures", True),
        ("reward/service_retries", True),
        ("reward/service_requests", True),
        ("rollout/tokens", True),
        ("x/count", True),
        ("rollout/tokens_per_s", False),
        ("reward/mean", False),
        ("rollout/response_len_mean", False),
        ("weight_sync/buckets", False),
    ],
)
def test_counter_naming_rule(key, summed):
    assert is_counter(key) is summed
    assert reduce_step_metric(key, 6.0, 3) == (6.0 if summed else 2.0)


@pytest.mark.parametrize("k", [0, 1])
def test_period_is_finish_to_finish_and_shorter_than_latency_when_steps_overlap(k):
    _, sched = simulate(3, max_offpolicy_steps=k, steps=5)
    rows = [m for _, m in sched.pop_finished()]
    starts = [e.t for e in sched.events if e.kind == "start"]
    finishes = [e.t for e in sched.events if e.kind == "finish"]
    assert len(rows) == 5
    # Periods tile the run: they add up to first start -> last finish.
    assert sum(r["timing/period"] for r in rows) == pytest.approx(finishes[-1] - starts[0])
    for r in rows:
        assert r["perf/samples_per_s"] == pytest.approx(8 / r["timing/period"])
    shorter = [r["timing/period"] < r["timing/step"] for r in rows]
    assert any(shorter) if k else not any(shorter)


def _first_round(**run: Any) -> list[Any]:
    """The rollout dispatches of step 0's first scheduling round."""
    plan = build_plan(load_topology(topology(**run)))
    sched = Scheduler(plan, clock=lambda: 0.0)
    source = create_source(plan.topology.data, 0)
    for s in sched.data_requests():
        sched.add_data(s, source.batch(s, plan.topology.run.step_batch))
    return [d for d in sched.ready() if d.op.index == 0 and d.step == 0]


def test_a_rounds_micro_batches_to_one_replica_form_its_gang():
    """The micro-batches of one op that one round sends to one replica are its gang
    (scheduler.mark_gangs; the hf rollout runs a gang as one batch): two replicas, room
    for two tasks each, four micro-batches -> mbs 0, 2 on replica 0 and 1, 3 on 1."""
    first = _first_round(max_inflight=2)
    got = [(d.mb_id, d.replicas, d.gang) for d in first]
    assert got == [(0, (0,), (0, 2)), (1, (1,), (1, 2)), (2, (0,), (0, 2)), (3, (1,), (1, 2))]
    assert gang_params(first[2].gang) == {"mb_gang": 2, "mb_gang_first": 0}
    alone = _first_round(max_inflight=1)  # one task per replica: each micro-batch alone
    assert [(d.mb_id, d.gang[1]) for d in alone] == [(0, 1), (1, 1)]
    assert gang_params(alone[0].gang) == {}

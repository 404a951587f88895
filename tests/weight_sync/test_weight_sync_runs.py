"""Disaggregated reshard over real stage processes: the actor (trainer/0) streams its
trained weights to the rollout (gen/0) through shared memory after every step.

The rollout starts from other initial weights than the actor (init seeds differ), so
the rollout's step-1 greedy output can only equal the actor's if the weights really
moved; the actor's step-0 update is replayed here to know what "the actor's own greedy
output" is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from ws_helpers import ACTOR_SEED, ROLLOUT_SEED, ShmProbe, disaggregated, greedy, shm_names

from hybridflow.config.schema import load_topology
from hybridflow.errors import PipelineError
from hybridflow.pipeline.runtime.launcher import LocalLauncher
from hybridflow.pipeline.runtime.runner import run_topology
from hybridflow.stages.actor import Actor
from hybridflow.stages.base import StageContext

COLLECT = ("prompt_ids", "prompt_mask", "response_ids", "rollout_logprobs", "old_logprobs")


def _replayed_actor(step0: dict[str, torch.Tensor], options: dict) -> Actor:
    """The actor after step 0, rebuilt here: same init, same batch, same update."""
    actor = Actor()
    actor.setup(
        StageContext(
            stage="trainer",
            replica=0,
            device=torch.device("cpu"),
            seed=0,
            run_dir=Path("/nonexistent"),
            options=options,
        )
    )
    batch = {k: step0[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "old_logprobs")}
    batch["response_mask"] = torch.ones_like(batch["response_ids"])  # stop_on_eos: false
    batch["advantages"] = torch.ones(batch["response_ids"].shape)
    actor.handle("update", batch, {})
    actor.handle("optimizer_step", {}, {})
    return actor


class _Pids(LocalLauncher):
    def start(self, specs):  # type: ignore[no-untyped-def]
        super().start(specs)
        self.started = self.pids()


def _gone(run_id: str, launcher: _Pids) -> list[str]:
    left = [f"pid {p}" for p in launcher.started.values() if os.path.exists(f"/proc/{p}")]
    return left + shm_names(run_id)


@pytest.mark.parametrize("protocol", ["ipc", "tcp", "ipc-staged"])
def test_rollout_stage_generates_what_the_trained_actor_generates(tmp_path, protocol):
    # tcp: the weight link's port is a socket the session bound and kept listening; the
    # sending process adopts it (ZMQ_USE_FD), no close-rebind window. staged: the rollout
    # takes the buckets into its own memory first and loads them at its barrier.
    d = disaggregated(tmp_path)
    protocol, _, staged = protocol.partition("-")
    if staged:
        d["dataflow"][-1]["params"] = {"stage_weights": True}
    d["transport"] = {**d.get("transport", {}), "protocol": protocol}
    run_id, launcher = f"wsrun-greedy-{protocol}", _Pids()
    probe = ShmProbe(run_id)
    res = run_topology(
        load_topology(d), collect=COLLECT, run_id=run_id, sinks=[probe], launcher=launcher
    )
    step = [{k: v[0] for k, v in res.collected[s].items()} for s in (0, 1)]
    prompts = [{k: step[s][k] for k in ("prompt_ids", "prompt_mask")} for s in (0, 1)]

    # Step 0: the rollout still has its own initial weights, not the actor's.
    assert torch.equal(step[0]["response_ids"], greedy(ROLLOUT_SEED, prompts[0])["response_ids"])
    assert (step[0]["rollout_logprobs"] - step[0]["old_logprobs"]).abs().max() > 0.1

    # Step 1: after actor.reshard -> rollout.load_weights, the rollout holds the trained
    # actor's weights: its greedy tokens are the actor's, and its log-probs are the ones
    # the actor itself computed on them (get_logprob ran in the trainer process).
    actor = _replayed_actor(step[0], d["stages"]["trainer"]["roles"]["actor"]["options"])
    mine = greedy(ROLLOUT_SEED, prompts[1], actor.named_weights())
    assert torch.equal(step[1]["response_ids"], mine["response_ids"])
    torch.testing.assert_close(step[1]["rollout_logprobs"], mine["rollout_logprobs"])
    torch.testing.assert_close(
        step[1]["rollout_logprobs"], step[1]["old_logprobs"], atol=1e-4, rtol=0
    )
    # ... and the training did change them: the untrained actor answers otherwise.
    untrained = greedy(ACTOR_SEED, prompts[1])
    assert (untrained["rollout_logprobs"] - mine["rollout_logprobs"]).abs().max() > 0.1

    m = res.metrics[1]
    assert m.get("weight_sync/staged", 0.0) == (1.0 if staged else 0.0)
    assert m["rollout/policy_version"] == 1.0 and m["actor/policy_version"] == 2.0
    # ~0.5 MB of weights in buckets of <= 0.02 MB: many buckets, all bytes moved once.
    assert m["weight_sync/buckets"] > 10 and m["weight_sync/bytes"] == m["reshard/bytes"]
    assert probe.seen == [[], []]  # between steps no segment is left unmapped in /dev/shm
    assert _gone(run_id, launcher) == []


def test_rollout_killed_mid_sync_stops_the_run_naming_it(tmp_path):
    """The receiving process is SIGKILLed at its first bucket: the run ends at once with an
    error naming the rollout stage and the sync, and leaves nothing behind."""
    d = disaggregated(tmp_path, steps=1)
    d["stages"]["gen"]["roles"]["rollout"] = {
        "backend": "synthetic",
        "options": {"die_at": {"op": "load_weights", "step": 0}},
    }
    d["dataflow"] = [op for op in d["dataflow"] if op["op"] in ("reshard", "load_weights")]
    run_id, launcher = "wsrun-dies", _Pids()
    with pytest.raises(PipelineError) as err:
        run_topology(load_topology(d), run_id=run_id, launcher=launcher)
    text = str(err.value)
    # Whoever notices first: the coordinator (stage gen died in load_weights) or the
    # actor's sender (receiver rollout@gen/0 died during the weight sync).
    assert "gen" in text and ("load_weights" in text or "weight sync" in text), text
    assert _gone(run_id, launcher) == []


@pytest.mark.parametrize("staged", [False, True], ids=["streamed", "staged"])
def test_offpolicy_rollout_keeps_generating_on_the_old_weights(tmp_path, staged):
    """max_offpolicy_steps = 1: rollout of step s may run before step s-1's weights land;
    every rollout then runs on a complete version within the bound (s-1 or s), and the
    reshard/load pair never deadlocks behind generates queued on the rollout stage. With
    `stage_weights` the buckets are received beside those generates and loaded after."""
    d = disaggregated(tmp_path, steps=3, k=1)
    d["run"].update(step_batch=8, micro_batch=4)  # two generates per step to queue up
    if staged:
        d["dataflow"][-1]["params"] = {"stage_weights": True}
    res = run_topology(load_topology(d))
    assert all(m.get("weight_sync/staged", 0.0) == float(staged) for m in res.metrics)
    versions = [m.get("rollout/policy_version", 0.0) for m in res.metrics]
    assert versions[0] == 0.0  # initial weights (no update yet)
    for s, v in enumerate(versions[1:], start=1):
        assert s - 1 <= v <= s, versions
    assert [m["actor/policy_version"] for m in res.metrics] == [1.0, 2.0, 3.0]


@pytest.mark.multigpu
def test_weights_move_over_nccl_between_two_gpus(tmp_path):
    """Actor on cuda:0, rollout on cuda:1: the link picks the NCCL tier (a private group
    built at the first sync) and the rollout's step-1 log-probs are the trained actor's.
    Not run on the CPU machine this was written on (skipped without two GPUs)."""
    d = disaggregated(tmp_path)
    d["stages"]["trainer"]["devices"] = "cuda:0"
    d["stages"]["gen"]["devices"] = "cuda:1"
    topo = load_topology(d)
    res = run_topology(topo, collect=COLLECT, run_id="wsrun-nccl")
    step1 = {k: v[0] for k, v in res.collected[1].items()}
    torch.testing.assert_close(step1["rollout_logprobs"], step1["old_logprobs"], atol=1e-3, rtol=0)
    assert res.metrics[1]["weight_sync/bytes"] == res.metrics[1]["reshard/bytes"]
    assert shm_names("wsrun-nccl") == []


def test_a_sharded_actor_streams_its_gathered_weights_from_rank_0(tmp_path):
    """The trainer stage on two ranks (one FSDP model): rank 0 gathers each bucket and
    streams it, rank 1 takes part in every gather and sends nothing. The rollout then
    generates what one process's trained actor generates."""
    d = disaggregated(tmp_path)
    d["stages"]["trainer"]["replicas"] = 2  # 4 rows per micro-batch: 2 per rank
    res = run_topology(load_topology(d), collect=COLLECT, run_id="wsrun-fsdp")
    step = [{k: v[0] for k, v in res.collected[s].items()} for s in (0, 1)]
    prompts = {k: step[1][k] for k in ("prompt_ids", "prompt_mask")}
    actor = _replayed_actor(step[0], d["stages"]["trainer"]["roles"]["actor"]["options"])
    mine = greedy(ROLLOUT_SEED, prompts, actor.named_weights())
    assert torch.equal(step[1]["response_ids"], mine["response_ids"])
    torch.testing.assert_close(
        step[1]["rollout_logprobs"], mine["rollout_logprobs"], atol=1e-4, rtol=0
    )
    m = res.metrics[1]
    assert m["weight_sync/buckets"] > 10 and m["weight_sync/bytes"] == m["reshard/bytes"]
    assert m["actor/updates"] == 1.0  # one group, one update (not one per rank)

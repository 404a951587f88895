"""Liveness rules on plain bookkeeping (no processes): which condition wins, and the exact
messages for the cases the process tests cannot reach cheaply (startup timeout)."""

from __future__ import annotations

from hybridflow.config.schema import LivenessConfig
from hybridflow.errors import StageError
from hybridflow.pipeline.plan.planner import ProcessInfo
from hybridflow.pipeline.runtime.launcher import ProcessExit
from hybridflow.pipeline.runtime.peers import StagePeer, check_deadlines, check_liveness
from hybridflow.transport.liveness import PeerTable
from hybridflow.transport.protocol import Heartbeat

LIVE = LivenessConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=2.0, startup_timeout_s=10.0)


def peers() -> dict[bytes, StagePeer]:
    out = {}
    for stage in ("rollout", "reward"):
        p = StagePeer(ProcessInfo(stage, 0, "cpu", (stage,)), pid=100, connected=True, ready=True)
        out[p.ident] = p
    return out


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table(ps: dict[bytes, StagePeer], clock: Clock, last_seen: dict[bytes, float]) -> PeerTable:
    """The coordinator's last-seen table with the given times (a fake clock)."""
    out = PeerTable(LIVE.heartbeat_timeout_s, clock=clock)
    for ident, p in ps.items():
        clock.now = last_seen.get(ident, 0.0)
        out.add(ident, stage=p.info.stage, replica=0, pid=p.pid)
    return out


def test_all_well():
    ps, clock = peers(), Clock()
    seen = table(ps, clock, {})
    clock.now = 1.0
    assert check_liveness(ps, [], 1.0, LIVE, seen=seen, started_at=0.0, all_ready=True) is None


def test_exit_wins_and_names_the_task():
    ps = peers()
    ps[b"reward/0"].given(7, ("reward.score", 3, 5))
    ps[b"reward/0"].given(8, ("reward.score", 3, 6))
    exits = [ProcessExit("reward/0", 100, -9)]
    seen = table(ps, Clock(), {})
    peer, err = check_liveness(ps, exits, 1.0, LIVE, seen=seen, started_at=0.0, all_ready=True)
    assert peer is ps[b"reward/0"]
    assert str(err) == (
        "stage reward replica 0 (pid 100) was killed by SIGKILL while running reward.score "
        "step 3 micro-batch 5 (queued: reward.score step 3 micro-batch 6)"
    )
    assert (err.stage, err.replica, err.step, err.mb_id) == ("reward", 0, 3, 5)


def test_silence_names_the_setting():
    ps, clock = peers(), Clock()
    seen = table(ps, clock, {b"rollout/0": 5.0, b"reward/0": 7.0})
    clock.now = 7.5
    ps[b"rollout/0"].given(1, ("rollout.load_weights", 2, -1))
    ps[b"rollout/0"].answered(1)
    _, err = check_liveness(ps, [], 7.5, LIVE, seen=seen, started_at=0.0, all_ready=True)
    assert str(err) == (
        "stage rollout replica 0 (pid 100) sent nothing for 2.5s while idle; its last task "
        "was rollout.load_weights step 2 (step op); liveness.heartbeat_timeout_s = 2.0 bounds "
        "this wait (raise it if the stage blocks its event loop)"
    )
    seen = table(ps, clock, {b"rollout/0": 7.0, b"reward/0": 0.0})
    clock.now = 7.5
    _, err = check_liveness(ps, [], 7.5, LIVE, seen=seen, started_at=0.0, all_ready=True)
    assert str(err).startswith(
        "stage reward replica 0 (pid 100) sent nothing for 7.5s before it was given any task;"
    )


def test_startup_timeout_lists_who_is_late():
    ps = peers()
    ps[b"reward/0"].ready = False
    ps[b"rollout/0"].ready = ps[b"rollout/0"].connected = False
    clock = Clock()
    seen = table(ps, clock, {b"rollout/0": 10.0, b"reward/0": 10.0})
    clock.now = 10.5
    _, err = check_liveness(ps, [], 10.5, LIVE, seen=seen, started_at=0.0, all_ready=False)
    assert str(err) == (
        "stages not ready within liveness.startup_timeout_s = 10.0s: "
        "rollout/0 (never connected), reward/0 (setting up)"
    )


def beat(running=(), queued=(), busy_s=0.0) -> Heartbeat:
    return Heartbeat(
        stage="reward",
        replica=0,
        seq=0,
        running=list(running),
        queued=list(queued),
        worker_busy_s=busy_s,
    )


def test_task_deadline_counts_from_its_start_and_names_op_step_and_setting():
    ps = peers()
    reward = ps[b"reward/0"]
    reward.given(7, ("reward.score", 3, 5))
    reward.sent(7, 10.0, 4.0, "dataflow[1].timeout_s")
    reward.progress(beat(queued=[7]), 11.0)  # received, waiting: no deadline yet
    assert check_deadlines(ps, 100.0, LIVE) is None
    reward.progress(beat(running=[7], busy_s=0.5), 100.0)  # the clock starts here
    reward.progress(beat(running=[7], busy_s=3.5), 103.0)
    assert check_deadlines(ps, 104.0, LIVE) is None
    err = check_deadlines(ps, 104.5, LIVE)
    assert isinstance(err, StageError)
    assert str(err) == (
        "stage reward replica 0 (pid 100): reward.score step 3 micro-batch 5 not answered 4s "
        "after it started (the stage is alive but the task is stuck; its worker thread has "
        "finished nothing for 3.5s); `dataflow[1].timeout_s` = 4s bounds one task of this op: "
        "raise it if the op is merely slow"
    )
    assert (err.stage, err.replica, err.step, err.mb_id) == ("reward", 0, 3, 5)
    reward.answered(7)
    assert check_deadlines(ps, 1000.0, LIVE) is None


def test_task_no_heartbeat_lists_is_lost_after_the_heartbeat_timeout():
    ps = peers()
    reward = ps[b"reward/0"]
    reward.given(9, ("reward.score", 0, 1))
    reward.sent(9, 10.0, 3600.0, "liveness.task_timeout_s")
    reward.progress(beat(), 11.0)  # a heartbeat without it (it may have crossed the Task)
    assert check_deadlines(ps, 12.0, LIVE) is None
    err = check_deadlines(ps, 12.5, LIVE)
    assert isinstance(err, StageError)
    assert str(err).startswith(
        "stage reward replica 0 (pid 100) never received reward.score step 0 micro-batch 1: "
        "none of its heartbeats listed it in the 2.5s since it was sent"
    )
    assert "`liveness.heartbeat_timeout_s` = 2s bounds this wait" in str(err)

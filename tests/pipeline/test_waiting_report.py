"""Who waits on whom, and for how long it may: the per-op default deadlines (one table,
pipeline/runtime/watch/deadlines.py, docs/reliability.md's) and the waiting lines the
coordinator logs while anything is awaited longer than `liveness.report_interval_s`.

The process test is the issue's case: a deadlocked reward function with no `timeout_s`
of its own prints the waiting line first, naming stage, op, step, micro-batch, the last
heartbeat and the bound, and is then ended by its op's default (shortened here by
patching the table, so the test is fast: the check is of behaviour, not of the clock)."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from pathlib import Path
from types import MappingProxyType

import pytest
from pipeline_helpers import RecordingLauncher, leftovers

from hybridflow.config.schema import LivenessConfig, OpConfig, load_topology
from hybridflow.errors import StageError
from hybridflow.pipeline.plan.planner import ProcessInfo
from hybridflow.pipeline.runtime.peers import StagePeer
from hybridflow.pipeline.runtime.runner import run_topology
from hybridflow.pipeline.runtime.watch import deadlines, waiting
from hybridflow.pipeline.runtime.watch.deadlines import (
    DEFAULT_TIMEOUT_S,
    DRIVER_TIMEOUT_S,
    op_bound,
)
from hybridflow.pipeline.runtime.watch.status import STATUS_FILE
from hybridflow.transport.protocol import Heartbeat, StageState

REPO = Path(__file__).resolve().parents[2]
LIVE = LivenessConfig()


def test_each_op_gets_its_own_default_and_timeout_s_still_wins():
    score = OpConfig(role="reward", op="score")
    b = op_bound(score, 1, LIVE)
    assert (b.seconds, b.key) == (600.0, "dataflow[1].timeout_s")
    assert b.text() == "`dataflow[1].timeout_s` = 600s (unset: the default for `score` ops)"
    assert op_bound(OpConfig(role="rollout", op="generate"), 0, LIVE).seconds == 1800.0
    own = op_bound(OpConfig(role="reward", op="score", timeout_s=5.0), 1, LIVE)
    assert own.text() == "`dataflow[1].timeout_s` = 5s"
    custom = op_bound(OpConfig(role="judge", op="grade"), 3, LIVE)  # unknown op: catch-all
    assert custom.text() == "`liveness.task_timeout_s` = 3600s (dataflow[3].timeout_s unset)"
    capped = op_bound(score, 1, LivenessConfig(task_timeout_s=60.0))
    assert capped.text() == (
        "`liveness.task_timeout_s` = 60s (caps the 600s default for `score` ops; "
        "dataflow[1].timeout_s unset)"
    )
    driver = op_bound(OpConfig(role="driver", op="grpo_advantages"), 2, LIVE)
    assert driver.seconds == DRIVER_TIMEOUT_S
    assert driver.note == "unset: the default for driver ops"


def test_the_docs_table_is_the_code_table():
    text = (REPO / "docs" / "reliability.md").read_text()
    rows = dict(re.findall(r"^\| ((?:`\w+`(?:, )?)+) \| (\d+) min \|", text, re.M))
    found: dict[str, float] = {}
    for ops, minutes in rows.items():
        for op in re.findall(r"`(\w+)`", ops):
            found[op] = float(minutes) * 60
    assert found == {**DEFAULT_TIMEOUT_S, "driver": DRIVER_TIMEOUT_S}


def _reward_peer() -> StagePeer:
    return StagePeer(ProcessInfo("reward", 0, "cpu", ("reward",)), pid=4242, connected=True)


def test_the_waiting_line_names_stage_op_step_heartbeat_and_bound():
    peer = _reward_peer()
    bound = op_bound(OpConfig(role="reward", op="score"), 1, LIVE)
    for task_id, mb in ((7, 1), (8, 2), (9, 3), (10, 4)):
        peer.given(task_id, ("reward.score", 0, mb))
        peer.given_at[task_id] = 1000.0  # time.monotonic() when it was given
        peer.sent(task_id, 50.0, bound.seconds, bound.key, note=bound.note)
    peer.progress(
        Heartbeat(
            stage="reward",
            replica=0,
            seq=3,
            state=StageState.BUSY,
            running=[7],
            queued=[8, 9, 10],
            worker_busy_s=61.2,
        ),
        50.5,
    )
    (w,) = waiting.waits([peer], 111.9, 1062.0, LIVE)
    assert w.line() == (
        "waiting 62s on stage reward replica 0 (pid 4242) for reward.score step 0 "
        "micro-batch 1 (running 61s; 3 more in flight); last heartbeat 61s ago: busy, "
        "1 running, 3 queued, worker thread 61s without finishing a task; bound: "
        "`dataflow[1].timeout_s` = 600s (unset: the default for `score` ops), 539s left"
    )
    assert (w.stage, w.replica, w.step, w.mb_id) == ("reward", 0, 0, 1)
    peer.answered(7)
    peer.last_result_at = 1062.0
    (w,) = waiting.waits([peer], 112.0, 1063.0, LIVE)
    assert w.what == "reward.score step 0 micro-batch 2"
    assert w.detail == "queued on the stage, not started; 2 more in flight"
    assert w.heartbeat.endswith(", last result 1.0s ago")
    assert w.bound.endswith("once it starts")


def test_a_checkpoint_save_and_stages_at_startup_are_waits_too():
    peer = _reward_peer()
    peer.given(-1, ("checkpoint_save", 4, -1))
    peer.given_at[-1] = 10.0
    (w,) = waiting.waits([peer], 0.0, 75.0, LIVE)
    assert w.line() == (
        "waiting 65s on stage reward replica 0 (pid 4242) for checkpoint_save after step 4 "
        "(control call); no heartbeat yet; bound: `liveness.control_timeout_s` = 600s, "
        "535s left"
    )
    actor = StagePeer(ProcessInfo("actor", 0, "cpu", ("actor",)))
    (s,) = waiting.startup_waits([actor], 90.0, 0.0, LIVE)
    assert s.line() == (
        "waiting 90s on stage actor replica 0 for setup (not connected yet); "
        "bound: `liveness.startup_timeout_s` = 120s, 30s left"
    )
    (d,) = waiting.data_waits("prompts", {3: 5.0}, 70.0)
    assert d.line() == (
        "waiting 65s on data source 'prompts' for the batch of step 3 (in the coordinator's "
        "io thread); bound: none (a data source's batch() is not timed out)"
    )


def test_the_reporter_logs_long_waits_once_per_interval():
    r = waiting.Reporter(60.0)
    short = waiting.Wait(on="x", what="y", waited_s=59.0)
    long = waiting.Wait(on="x", what="y", waited_s=60.0)
    assert r.due([short], 0.0) == []
    assert r.due([short, long], 1.0) == [long]  # as soon as one crosses the interval
    assert r.due([long], 30.0) == []
    assert r.due([long], 61.0) == [long]
    assert r.due([short], 62.0) == []  # nothing long: the next long one reports at once
    assert r.due([long], 63.0) == [long]


@pytest.mark.timeout(90)
def test_a_stuck_reward_function_is_reported_waiting_then_ended_by_its_default(
    topo_dict, monkeypatch, caplog
):
    monkeypatch.setattr(
        deadlines, "DEFAULT_TIMEOUT_S", MappingProxyType({**DEFAULT_TIMEOUT_S, "score": 3.0})
    )
    data = topo_dict(steps=2)
    data["stages"]["reward"]["roles"]["reward"] = {
        "backend": "function",
        "options": {
            "function": "tests.pipeline.stuck_fns:deadlocked_reward",
            "tokenizer": "builtin",
        },
    }
    data["dataflow"][1]["inputs"] = ["prompt_ids", "response_ids"]
    assert "timeout_s" not in data["dataflow"][1]  # the op's default bounds it
    data["liveness"]["report_interval_s"] = 0.5
    launcher, run_id = RecordingLauncher(), uuid.uuid4().hex[:12]
    caplog.set_level(logging.WARNING, logger="hybridflow.coordinator")
    with pytest.raises(StageError) as info:
        run_topology(load_topology(data), run_id=run_id, launcher=launcher)
    ended = time.time()
    err = info.value
    text = str(err)
    assert (err.stage, err.replica, err.step) == ("reward", 0, 0), text
    assert "reward.score step 0 micro-batch " in text and "after it started" in text, text
    assert (
        "`dataflow[1].timeout_s` = 3s (unset: the default for `score` ops) bounds one task "
        "of this op" in text
    ), text

    lines = [r for r in caplog.records if r.getMessage().startswith("waiting ")]
    assert lines, [r.getMessage() for r in caplog.records]
    assert lines[0].created < ended  # printed while it waited, before the error
    pid = launcher.started["reward/0"]
    awaited = f"on stage reward replica 0 (pid {pid}) for reward.score step 0 micro-batch "
    reward = [r.getMessage() for r in lines if awaited in r.getMessage()]
    assert reward, [r.getMessage() for r in lines]
    first = reward[0]
    assert re.fullmatch(
        r"waiting [\d.]+s on stage reward replica 0 \(pid \d+\) for reward\.score step 0 "
        r"micro-batch \d+ \((running [\d.]+s|queued on the stage, not started)"
        r"(; \d+ more in flight)?\); last heartbeat [\d.]+s ago: (busy|ready), \d+ running, "
        r"\d+ queued, (worker thread [\d.]+s without finishing a task|worker thread idle)"
        r"(, last result [\d.]+s ago)?; bound: `dataflow\[1\]\.timeout_s` = 3s "
        r"\(unset: the default for `score` ops\)(, [\d.]+s left| once it starts)",
        first,
    ), first
    assert any("running" in m and "1 running" in m for m in reward), reward
    assert not [m for m in reward if "past it" in m]  # ended by its bound, not later

    status = json.loads((Path(data["run_dir"]) / STATUS_FILE).read_text())
    assert status["state"] == "failed" and status["pid"] > 0
    assert status["error"].startswith("stage reward replica 0 (pid "), status
    assert not leftovers(run_id, launcher.started)

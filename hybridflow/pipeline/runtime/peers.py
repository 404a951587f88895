"""What the coordinator knows about each stage replica, and when that means "dead".

`StagePeer` is bookkeeping only: handshake state and the tasks sent and not yet answered
(oldest first: the one it is working on), and, for the waiting report
(pipeline/runtime/watch/waiting.py), its last heartbeat and when each task was given. When each
stage was last heard from lives in a `transport.liveness.PeerTable` (one last-seen table
and silence rule for the code base). `check_liveness` turns that plus the launcher's exit
reports into the run's error, or None:

  - a process exited (kill -9, crash, early exit)      -> StageDeadError with its exit status
  - a connected stage silent > heartbeat_timeout_s     -> StageDeadError naming the setting
  - not every stage ready by startup_timeout_s         -> StageDeadError listing who is late
`check_deadlines` bounds each task sent to a stage (the stage is alive, its task is not
moving):
  - running longer than its op's deadline              -> StageError naming the op, step,
    (`dataflow[i].timeout_s`, else the op's default       micro-batch and the setting; the
    in pipeline/runtime/watch/deadlines.py), counted from the   clock starts when a heartbeat
    first heartbeat that lists it running                 first lists the task running
  - listed by no heartbeat (queued or running) for     -> StageError: the Task was lost on
    liveness.heartbeat_timeout_s after it was sent        the way or the stage could not
                                                          decode it
Every message names stage, replica, pid and what it was doing (op, step, micro-batch).
The coordinator's liveness loop calls both on a short tick; they never block.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hybridflow.config.schema import LivenessConfig
from hybridflow.errors import StageDeadError, StageError
from hybridflow.pipeline.plan.planner import ProcessInfo
from hybridflow.pipeline.runtime.launcher import ProcessExit
from hybridflow.transport.liveness import PeerTable
from hybridflow.transport.protocol import Heartbeat

TaskRef = tuple[str, int, int]  # (op label, step, mb_id); mb_id -1 for a step op


@dataclass
class TaskClock:
    """The deadline bookkeeping of one Task sent to a stage (loop clock times)."""

    timeout_s: float  # the op's bound once started
    setting: str  # the dotted key that sets it, for the error message
    sent: float  # when the Task left the coordinator
    started: float = 0.0  # when a heartbeat first listed it running (0: not yet)
    seen: bool = False  # a heartbeat listed it (queued or running): the stage has it
    note: str = ""  # why this bound when `setting` is unset (deadlines.Bound.note)

    @property
    def bound(self) -> str:
        return f"`{self.setting}` = {self.timeout_s:g}s" + (f" ({self.note})" if self.note else "")


@dataclass
class StagePeer:
    info: ProcessInfo
    pid: int = 0
    connected: bool = False  # Hello accepted
    ready: bool = False  # setup done (a "ready"/"busy" heartbeat arrived)
    inflight: dict[int, TaskRef] = field(default_factory=dict)  # task_id -> task, send order
    last_given: TaskRef | None = None
    clocks: dict[int, TaskClock] = field(default_factory=dict)  # task_id -> its deadline
    worker_busy_s: float = 0.0  # from the last heartbeat
    # For the waiting report (pipeline/runtime/watch/waiting.py): the last heartbeat and when
    # it came (loop clock), when each task in flight was given and when the last answer
    # came (time.monotonic(): `given` is called where no loop clock is passed in).
    heartbeat: Heartbeat | None = None
    heartbeat_at: float = 0.0
    given_at: dict[int, float] = field(default_factory=dict)
    last_result_at: float = 0.0

    @property
    def ident(self) -> bytes:
        return self.info.name.encode()

    def given(self, task_id: int, task: TaskRef) -> None:
        self.inflight[task_id] = self.last_given = task
        self.given_at[task_id] = time.monotonic()

    def answered(self, task_id: int) -> None:
        self.inflight.pop(task_id, None)
        self.clocks.pop(task_id, None)
        if self.given_at.pop(task_id, None) is not None:
            self.last_result_at = time.monotonic()

    def sent(
        self, task_id: int, now: float, timeout_s: float, setting: str, note: str = ""
    ) -> None:
        """The Task left the coordinator: its lost-task bound starts now."""
        if task_id in self.inflight:  # not answered meanwhile
            self.clocks[task_id] = TaskClock(timeout_s, setting, now, note=note)

    def progress(self, hb: Heartbeat, now: float) -> None:
        """A heartbeat's task lists: start the deadline of tasks it shows running."""
        self.worker_busy_s = hb.worker_busy_s
        self.heartbeat, self.heartbeat_at = hb, now
        for task_id in hb.running:
            clock = self.clocks.get(task_id)
            if clock is not None:
                clock.seen = True
                clock.started = clock.started or now
        for task_id in hb.queued:
            clock = self.clocks.get(task_id)
            if clock is not None:
                clock.seen = True

    def doing(self) -> str:
        """What this stage was doing, for an error message."""
        if self.inflight:
            tasks = [task_text(t) for t in self.inflight.values()]
            queued = f" (queued: {', '.join(tasks[1:])})" if len(tasks) > 1 else ""
            return f"while running {tasks[0]}{queued}"
        if self.last_given:
            return f"while idle; its last task was {task_text(self.last_given)}"
        return "before it was given any task"

    def where(self) -> dict[str, Any]:
        cur = next(iter(self.inflight.values()), self.last_given)
        step, mb = (cur[1], cur[2]) if cur else (None, None)
        return {"stage": self.info.stage, "replica": self.info.replica, "step": step, "mb_id": mb}

    def name(self, pid: int | None = None) -> str:
        return f"stage {self.info.stage} replica {self.info.replica} (pid {pid or self.pid})"


def task_text(t: TaskRef) -> str:
    label, step, mb = t
    return f"{label} step {step} " + ("(step op)" if mb < 0 else f"micro-batch {mb}")


def check_deadlines(
    peers: dict[bytes, StagePeer], now: float, live: LivenessConfig
) -> StageError | None:
    """The first task past its deadline, or lost on its way to the stage, as an error."""
    for peer in peers.values():
        for task_id, clock in peer.clocks.items():
            ref = peer.inflight.get(task_id)
            if ref is None:
                continue
            where = {"stage": peer.info.stage, "replica": peer.info.replica}
            where |= {"step": ref[1], "mb_id": ref[2]}
            if clock.started and now - clock.started > clock.timeout_s:
                busy = peer.worker_busy_s
                stuck = (
                    f"; its worker thread has finished nothing for {busy:.1f}s"
                    if busy > clock.timeout_s / 2
                    else ""
                )
                return StageError(
                    f"{peer.name()}: {task_text(ref)} not answered {clock.timeout_s:g}s after "
                    f"it started (the stage is alive but the task is stuck{stuck}); "
                    f"{clock.bound} bounds one task of this op: "
                    "raise it if the op is merely slow",
                    **where,
                )
            if not clock.seen and now - clock.sent > live.heartbeat_timeout_s:
                return StageError(
                    f"{peer.name()} never received {task_text(ref)}: none of its heartbeats "
                    f"listed it in the {now - clock.sent:.1f}s since it was sent (the message "
                    "was lost or the stage could not decode it); "
                    f"`liveness.heartbeat_timeout_s` = {live.heartbeat_timeout_s:g}s bounds "
                    "this wait",
                    **where,
                )
    return None


def check_liveness(
    peers: dict[bytes, StagePeer],
    exits: Iterable[ProcessExit],
    now: float,
    live: LivenessConfig,
    *,
    seen: PeerTable,
    started_at: float,
    all_ready: bool,
) -> tuple[StagePeer | None, StageDeadError] | None:
    """The first dead/silent/late stage as (peer, error), or None if all is well.
    `exits`: processes the launcher saw exit; `seen`: the last-seen table of the connected
    stages (transport/liveness.py, the one silence rule of the code base); `now` and
    `started_at`: the loop clock, for the startup bound."""
    for ex in exits:
        peer = peers[ex.name.encode()]
        peer.pid = peer.pid or ex.pid  # it may have died before its Hello
        text = f"{peer.name(ex.pid)} {ex.describe()} {peer.doing()}"
        return peer, StageDeadError(text, **peer.where())
    for info in seen.expired():
        peer = peers.get(info.key)  # type: ignore[call-overload]
        if peer is None or not peer.connected:
            continue
        silent = seen.clock() - info.last_seen
        text = (
            f"{peer.name()} sent nothing for {silent:.1f}s {peer.doing()}; "
            f"liveness.heartbeat_timeout_s = {live.heartbeat_timeout_s} bounds this wait "
            "(raise it if the stage blocks its event loop)"
        )
        return peer, StageDeadError(text, **peer.where())
    if not all_ready and now - started_at > live.startup_timeout_s:
        late = [
            f"{p.info.name} ({'setting up' if p.connected else 'never connected'})"
            for p in peers.values()
            if not p.ready
        ]
        text = (
            f"stages not ready within liveness.startup_timeout_s = "
            f"{live.startup_timeout_s}s: {', '.join(late)}"
        )
        return None, StageDeadError(text)
    return None

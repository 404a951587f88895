"""Who waits on whom: what the coordinator is waiting for right now, as lines.

Pure functions over the coordinator's bookkeeping (no I/O, no clock of its own: the
times come in as arguments). The coordinator's liveness loop calls `waits` every
heartbeat interval; `Reporter` says which of them to log (console and log: anything
awaited longer than `liveness.report_interval_s`, once per interval), and the same list
goes to `<run_dir>/status.json` for `hybridflow status` (pipeline/runtime/watch/status.py).

What is awaited, one `Wait` each:
  - per stage replica with tasks or control calls in flight: the oldest of them (the
    others are counted), whether its heartbeats list it running or queued, what the last
    heartbeat said and the bound of that task;
  - per stage replica not ready yet (startup), bounded by liveness.startup_timeout_s;
  - per driver op running in the coordinator's compute thread;
  - per data batch being built by the data source in the io thread (not timed out).

One line, always in this shape (`Wait.line`):

    waiting 62s on stage reward replica 0 (pid 4242) for reward.score step 0 micro-batch 1
    (running 61s; 3 more in flight); last heartbeat 0.4s ago: busy, 1 running, 3 queued,
    worker thread 61s without finishing a task, last result 62s ago; bound:
    `dataflow[1].timeout_s` = 600s (unset: the default for `score` ops), 539s left

Invariant: `waits` never raises on partial bookkeeping (a peer with no heartbeat yet, a
task without a clock); a Wait is about the present only, never an error (those are
peers.check_deadlines / check_liveness).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from hybridflow.config.schema import LivenessConfig
from hybridflow.pipeline.runtime.peers import StagePeer, task_text
from hybridflow.pipeline.runtime.watch.deadlines import Bound


@dataclass(frozen=True)
class Wait:
    """One thing awaited: on whom, for what, since when, and what bounds it."""

    on: str  # "stage reward replica 0 (pid 4242)", "driver op ...", "data source 'x'"
    what: str  # "reward.score step 0 micro-batch 1", "setup", "the batch of step 3"
    waited_s: float
    detail: str = ""  # "running 61s; 3 more in flight"
    heartbeat: str = ""  # "last heartbeat 0.4s ago: busy, 1 running, ..."; "" if none
    bound: str = ""  # "`key` = 600s (note), 539s left"
    stage: str | None = None
    replica: int | None = None
    step: int | None = None
    mb_id: int | None = None

    def line(self) -> str:
        head = f"waiting {secs(self.waited_s)} on {self.on} for {self.what}"
        parts = [head + (f" ({self.detail})" if self.detail else "")]
        if self.heartbeat:
            parts.append(self.heartbeat)
        parts.append(f"bound: {self.bound or 'none'}")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "line": self.line()}


def secs(x: float) -> str:
    """62s, 4.5s, 0.4s: tenths below 10 seconds, whole seconds above."""
    return f"{x:.1f}s" if x < 10 else f"{x:.0f}s"


def _left(bound_s: float, used_s: float) -> str:
    left = bound_s - used_s
    return f"{secs(left)} left" if left >= 0 else f"{secs(-left)} past it"


def heartbeat_text(peer: StagePeer, now: float) -> str:
    """What the peer's last heartbeat said (`now`: the loop clock of `heartbeat_at`)."""
    hb = peer.heartbeat
    if hb is None:
        return "no heartbeat yet"
    parts = [hb.state.value, f"{len(hb.running)} running", f"{len(hb.queued)} queued"]
    if hb.worker_busy_s > 0:
        parts.append(f"worker thread {secs(hb.worker_busy_s)} without finishing a task")
    else:
        parts.append("worker thread idle")
    return f"last heartbeat {secs(max(0.0, now - peer.heartbeat_at))} ago: " + ", ".join(parts)


def stage_wait(peer: StagePeer, now: float, mono: float, live: LivenessConfig) -> Wait | None:
    """The oldest task or control call in flight to `peer`, or None if it has none.
    `now`: the loop clock (task clocks, heartbeats); `mono`: time.monotonic() (when
    tasks were given, when the last result came)."""
    if not peer.inflight:
        return None
    task_id, ref = next(iter(peer.inflight.items()))
    given = peer.given_at.get(task_id, mono)
    waited = max(0.0, mono - given)
    clock = peer.clocks.get(task_id)
    if task_id < 0:  # a control call (checkpoint save): no per-task clock
        detail, bound = (
            "control call",
            (
                f"`liveness.control_timeout_s` = {live.control_timeout_s:g}s, "
                + _left(live.control_timeout_s, waited)
            ),
        )
    elif clock is None:  # being sent
        detail, bound = "being sent", ""
    elif clock.started:
        ran = max(0.0, now - clock.started)
        detail, bound = f"running {secs(ran)}", f"{clock.bound}, {_left(clock.timeout_s, ran)}"
    elif clock.seen:
        detail = "queued on the stage, not started"
        bound = f"{clock.bound} once it starts"
    else:
        since = max(0.0, now - clock.sent)
        detail = "sent, no heartbeat has listed it yet"
        bound = (
            f"`liveness.heartbeat_timeout_s` = {live.heartbeat_timeout_s:g}s for a heartbeat "
            f"to list it, {_left(live.heartbeat_timeout_s, since)}"
        )
    more = len(peer.inflight) - 1
    if more:
        detail += f"; {more} more in flight"
    beat = heartbeat_text(peer, now)
    if peer.last_result_at:
        beat += f", last result {secs(max(0.0, mono - peer.last_result_at))} ago"
    return Wait(
        on=peer.name(),
        what=task_text(ref) if task_id >= 0 else f"{ref[0]} after step {ref[1]}",
        waited_s=waited,
        detail=detail,
        heartbeat=beat,
        bound=bound,
        stage=peer.info.stage,
        replica=peer.info.replica,
        step=ref[1],
        mb_id=ref[2] if ref[2] >= 0 else None,
    )


def startup_waits(
    peers: Iterable[StagePeer], now: float, started_at: float, live: LivenessConfig
) -> list[Wait]:
    """Every stage replica not ready yet, `now - started_at` after the launch."""
    waited = max(0.0, now - started_at)
    bound = f"`liveness.startup_timeout_s` = {live.startup_timeout_s:g}s, " + _left(
        live.startup_timeout_s, waited
    )
    return [
        Wait(
            on=p.name() if p.connected else f"stage {p.info.stage} replica {p.info.replica}",
            what="setup",
            waited_s=waited,
            detail="connected, setting up" if p.connected else "not connected yet",
            heartbeat=heartbeat_text(p, now) if p.connected else "",
            bound=bound,
            stage=p.info.stage,
            replica=p.info.replica,
        )
        for p in peers
        if not p.ready
    ]


def driver_wait(label: str, step: int, mb_id: int, ran_s: float, bound: Bound) -> Wait:
    """A driver op `ran_s` into its run in the coordinator's compute thread."""
    what = f"{label} step {step} " + ("(step op)" if mb_id < 0 else f"micro-batch {mb_id}")
    return Wait(
        on="the coordinator's compute thread",
        what=f"driver op {what}",
        waited_s=ran_s,
        detail="running",
        bound=f"{bound.text()}, {_left(bound.seconds, ran_s)}",
        stage="driver",
        step=step,
        mb_id=mb_id if mb_id >= 0 else None,
    )


def data_waits(source: str, fetching: Mapping[int, float], mono: float) -> list[Wait]:
    """Data batches the source is building (step -> time.monotonic() it started)."""
    return [
        Wait(
            on=f"data source {source!r}",
            what=f"the batch of step {step}",
            waited_s=max(0.0, mono - t0),
            detail="in the coordinator's io thread",
            bound="none (a data source's batch() is not timed out)",
            step=step,
        )
        for step, t0 in sorted(fetching.items())
    ]


def waits(peers: Iterable[StagePeer], now: float, mono: float, live: LivenessConfig) -> list[Wait]:
    """What every stage replica is awaited for (see `stage_wait`), longest first."""
    out = [w for p in peers if (w := stage_wait(p, now, mono, live)) is not None]
    return sorted(out, key=lambda w: -w.waited_s)


class Reporter:
    """When to log waiting lines: the waits longer than `interval_s`, at most once per
    interval (the first as soon as one crosses it); nothing while nothing waits long."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._next: float | None = None

    def due(self, found: Iterable[Wait], now: float) -> list[Wait]:
        long = [w for w in found if w.waited_s >= self.interval_s]
        if not long:
            self._next = None
            return []
        if self._next is not None and now < self._next:
            return []
        self._next = now + self.interval_s
        return long

"""The coordinator's liveness loop: is every stage alive, and is every task moving?

    every tick (<= 0.1 s)   launcher.poll() and heartbeat ages -> check_liveness (peers.py):
                            a process exited, a stage went silent, or setup took longer
                            than liveness.startup_timeout_s -> StageDeadError;
                            task deadlines -> check_deadlines (peers.py), and a driver op
                            running longer than its bound (deadlines.py) -> StageError
    every look              who waits on whom (waiting.py): a warning line per wait longer
    (heartbeat interval,    than liveness.report_interval_s, once per interval; the waits
     at most the report     go to the caller's `report` too (status.json, status.py)
     interval)

`Watchdog.run` returns the first error it finds, the job's end, and raises none. It
never blocks: it reads the tables the coordinator keeps (peers, the driver ops running,
the data batches being fetched), live. A stage found dead is forgotten by the channel
first (what the channel holds for it freed, its shared memory swept).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from hybridflow.config.schema import LivenessConfig
from hybridflow.errors import HybridflowError, StageError
from hybridflow.pipeline.runtime.launcher import Launcher
from hybridflow.pipeline.runtime.peers import StagePeer, check_deadlines, check_liveness
from hybridflow.pipeline.runtime.steps import Dispatch
from hybridflow.pipeline.runtime.watch import waiting
from hybridflow.pipeline.runtime.watch.deadlines import op_bound
from hybridflow.pipeline.runtime.watch.waiting import Reporter, Wait
from hybridflow.transport.channel import Channel
from hybridflow.transport.liveness import PeerTable

log = logging.getLogger("hybridflow.coordinator")


class Watchdog:
    def __init__(
        self,
        *,
        peers: dict[bytes, StagePeer],
        launcher: Launcher,
        seen: PeerTable,
        chan: Channel,
        live: LivenessConfig,
        data_source: str,
        drivers: dict[int, tuple[float, Dispatch]],
        fetching: dict[int, float],
    ) -> None:
        self.peers = peers
        self.launcher = launcher
        self.seen = seen  # when each connected stage was last heard from
        self.chan = chan
        self.live = live
        self.data_source = data_source  # its name, for the waiting report
        self.drivers = drivers  # task id -> (monotonic start, dispatch): driver ops running
        self.fetching = fetching  # step -> monotonic start of its data batch

    async def run(
        self,
        started_at: float,
        all_ready: asyncio.Future[None],
        report: Callable[[list[Wait]], None],
    ) -> HybridflowError:
        """Tick until a stage is dead or a task late; -> that error. `started_at`: the
        loop time the job started (bounds setup while `all_ready` is not done)."""
        live = self.live
        tick = min(0.1, live.heartbeat_interval_s / 2)
        loop = asyncio.get_running_loop()
        reporter = Reporter(live.report_interval_s)
        look_every = min(live.heartbeat_interval_s, live.report_interval_s)
        next_look = loop.time() + look_every
        while True:
            await asyncio.sleep(tick)
            # Deaths and deadlines first: a task past its bound is ended in this tick, not
            # reported as waiting "past it" first (the report and the bound share a tick).
            now = loop.time()
            dead = self.dead(now, started_at=started_at, all_ready=all_ready.done())
            if dead is not None:
                return dead
            late = check_deadlines(self.peers, loop.time(), live) or self.driver_late()
            if late is not None:
                return late
            if loop.time() >= next_look:  # who waits on whom: log lines, status.json
                next_look = loop.time() + look_every
                found = self.waits(started_at, all_ready.done())
                for w in reporter.due(found, loop.time()):
                    log.warning("%s", w.line())
                report(found)

    def dead(self, now: float, *, started_at: float, all_ready: bool) -> HybridflowError | None:
        """A process that exited, a silent stage, or a setup past its bound (peers.py)."""
        dead = check_liveness(
            self.peers,
            self.launcher.poll(),
            now,
            self.live,
            seen=self.seen,
            started_at=started_at,
            all_ready=all_ready,
        )
        if dead is None:
            return None
        peer, error = dead
        if peer is not None:  # free what the channel holds for it, sweep its shm
            self.chan.forget_peer(peer.ident, peer.pid or None)
        return error

    def waits(self, started_at: float, all_ready: bool) -> list[Wait]:
        """Everything awaited now, longest first (pipeline/runtime/watch/waiting.py)."""
        now, mono, live = asyncio.get_running_loop().time(), time.monotonic(), self.live
        found = waiting.waits(self.peers.values(), now, mono, live)
        if not all_ready:
            found += waiting.startup_waits(self.peers.values(), now, started_at, live)
        for t0, d in list(self.drivers.values()):
            bound = op_bound(d.op.cfg, d.op.index, live)
            found.append(waiting.driver_wait(d.op.label, d.step, d.mb_id, mono - t0, bound))
        found += waiting.data_waits(self.data_source, dict(self.fetching), mono)
        return sorted(found, key=lambda w: -w.waited_s)

    def driver_late(self) -> StageError | None:
        """A driver op running longer than its bound (its thread is abandoned: daemon)."""
        now = time.monotonic()
        for t0, d in list(self.drivers.values()):
            bound = op_bound(d.op.cfg, d.op.index, self.live)
            if now - t0 > bound.seconds:
                return StageError(
                    f"driver op {d.op.cfg.op} at step {d.step} "
                    + ("(step op)" if d.mb_id < 0 else f"micro-batch {d.mb_id}")
                    + f" has run {now - t0:.1f}s in the coordinator's compute thread; "
                    f"{bound.text()} bounds it: raise it if the op is merely slow",
                    stage="driver",
                    step=d.step,
                    mb_id=d.mb_id,
                )
        return None

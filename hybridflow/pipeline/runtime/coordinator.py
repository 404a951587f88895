"""The coordinator: drives the steps of one job over stage processes (asyncio, one loop).

Which loop waits for what, and who unblocks it:

    stage processes ==(ROUTER socket)==> recv loop
        Hello      -> Welcome (proof of the run secret, then config hash; the connection
                      is admitted: before that nothing else of it is acted on)  ready set grows
        Heartbeat  -> liveness clock of that replica             "ready" -> all_ready?
        Result     -> scheduler.complete()  --------------------> wake
        Failure    -> StageError (remote traceback)  -----------> done (error)

    data tasks     (io thread: DataSource.batch)  -> scheduler.add_data()   -> wake
    driver tasks   (compute thread: driver op)    -> scheduler.complete()   -> wake

    dispatch loop  waits on `wake`; then: request data, take every ready task from the
                   scheduler (pipeline/scheduler.py holds all ordering rules), send
                   Tasks / start driver tasks, hand finished steps to the metrics sinks
                   and their sample rows to the sample sinks (io thread: decoding and
                   writing), and resolves `done` after the last step.

    liveness loop  every tick: launcher.poll() (a process exited -> StageDeadError) and
                   heartbeat ages (> liveness.heartbeat_timeout_s -> StageDeadError);
                   before all stages are ready, liveness.startup_timeout_s bounds setup;
                   task deadlines: a task running (as the stage's heartbeats report it)
                   longer than its op's bound (pipeline/runtime/watch/deadlines.py), or
                   listed by no heartbeat within liveness.heartbeat_timeout_s of its
                   sending (lost), and a driver op running longer than its bound ->
                   StageError (rules and messages: pipeline/runtime/peers.py).
                   Every heartbeat interval: who waits on whom (pipeline/runtime/
                   waiting.py): a warning line per wait longer than
                   liveness.report_interval_s, once per interval, and status.json in
                   the run_dir this process holds the lock of (runtime/watch/status.py).
    undecodable    a message from a known stage that cannot be decoded while that stage
                   has tasks in flight (the channel's `on_bad_message`) -> StageError:
                   what it carried is lost, and waiting for it would hang.

    checkpoint     (with a Checkpointer) after a due step finished: the scheduler holds
                   the next step (`sched.hold`), every stage process answers a `Control`
                   call `CheckpointSave` (ControlDone within liveness.control_timeout_s)
                   by writing its part, the io thread commits the directory
                   (pipeline/checkpoint/store.py), the hold moves on -> wake. `done`
                   waits for the last save.

    run()          waits for `done` (result or error); teardown: cancel loops, gather.

One Coordinator runs one job (pipeline/runtime/session.py): the first job of a session
handshakes the stages it launched (Hello checked against the session's config hash); a
later job gets the session's peers, already ready, and starts dispatching at once
(after checking no process died since the last job).

Invariants: the event loop never computes (data sources, driver ops, sinks run in
threads); every wait has a bound named in its error; the first error wins and ends the
run; `policy_version` on every Task is the scheduler's version at dispatch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridflow.errors import (
    HybridflowError,
    PeerDeadError,
    PipelineError,
    StageError,
)
from hybridflow.pipeline.checkpoint.checkpointer import Checkpointer, load_drivers, save_drivers
from hybridflow.pipeline.driver.registry import resolve_driver_op
from hybridflow.pipeline.observe.metrics import MetricsSink
from hybridflow.pipeline.observe.samples import sample_sinks, samples_wanted
from hybridflow.pipeline.plan.planner import Plan, ProcessInfo
from hybridflow.pipeline.runtime.launcher import Launcher
from hybridflow.pipeline.runtime.peers import StagePeer, check_deadlines, check_liveness
from hybridflow.pipeline.runtime.scheduler import DRIVER_REPLICA, Dispatch, Event, Scheduler
from hybridflow.pipeline.runtime.watch import waiting
from hybridflow.pipeline.runtime.watch.deadlines import Bound, op_bound
from hybridflow.pipeline.runtime.watch.rundir_lock import held_here
from hybridflow.pipeline.runtime.watch.status import STATUS_FILE, StatusBoard
from hybridflow.pipeline.runtime.watch.waiting import Reporter, Wait
from hybridflow.pipeline.runtime.workers import DaemonExecutor
from hybridflow.pipeline.sources.registry import DataSource
from hybridflow.transport import auth
from hybridflow.transport.channel import Channel, Received
from hybridflow.transport.liveness import PeerTable
from hybridflow.transport.protocol import (
    CheckpointSave,
    Control,
    ControlDone,
    Failure,
    Heartbeat,
    Hello,
    Result,
    Shutdown,
    Task,
    Welcome,
)

log = logging.getLogger("hybridflow.coordinator")


def _stopping(exc: BaseException) -> bool:
    """Whether `exc`, raised where a data source or a driver op runs, is the coordinator
    being stopped (re-raised) rather than the source or op failing (a named error). Ctrl-C
    and SIGTERM reach a job as the cancellation of its task (asyncio.Runner, session.py),
    so that cancellation is the one interrupt; a KeyboardInterrupt, SystemExit or other
    BaseException out of the worker thread was raised by the source's or op's code, and
    escaping here it would stop the event loop (or vanish with its task) unnamed."""
    task = asyncio.current_task()
    return isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling() > 0


@dataclass
class RunResult:
    run_id: str
    metrics: list[dict[str, float]]  # one row per step, in step order
    events: list[Event]
    collected: dict[int, dict[str, list[torch.Tensor]]]  # step -> value -> per-mb tensors
    startup_s: float  # launch until every stage was ready
    wall_s: float  # first step started -> last step finished
    coordinator_cpu_s: float  # this process's CPU time over wall_s
    tasks: int  # tasks completed (a step op on N replicas counts N)
    exits: list[Any] = field(default_factory=list)  # launcher ProcessExit list
    checkpoints: list[str] = field(default_factory=list)  # directories committed, in order
    validation: list[dict[str, float]] = field(default_factory=list)  # val/ rows, `step` incl.


class Coordinator:
    def __init__(
        self,
        plan: Plan,
        channel: Channel,
        launcher: Launcher,
        source: DataSource,
        sinks: list[MetricsSink],
        *,
        run_id: str,
        collect: tuple[str, ...] = (),
        start_step: int = 0,
        checkpointer: Checkpointer | None = None,
        resume_dir: str | None = None,
        peers: dict[bytes, StagePeer] | None = None,
        config_hash: str | None = None,
        secret: bytes = b"",
        drivers: dict[int, Any] | None = None,
    ) -> None:
        self.plan = plan
        self.topo = plan.topology
        self.chan = channel
        self.launcher = launcher
        self.source = source
        self.sinks = sinks
        self.run_id = run_id
        self.sched = Scheduler(plan, start_step=start_step)
        self.sched.collect = collect
        # A few rows of every step, decoded with the data source's tokenizer and written
        # by the sinks that take samples (observe/samples.py), in the io thread.
        self.sched.sample_rows = samples_wanted(sinks)
        self._sample_sinks = sample_sinks(sinks)
        self._tokenizer = getattr(source, "tokenizer", None)
        self.checkpointer = checkpointer
        self.checkpoints: list[str] = []  # directories committed by this run
        self._saving = 0  # checkpoints in progress
        self._control: dict[int, asyncio.Future[None]] = {}
        self._next_control = 0  # Control calls have ids of their own (protocol.py)
        if checkpointer is not None:
            self.sched.hold = checkpointer.next_due(start_step) + 1
        # A session's processes outlive one coordinator: their handshake state (peers)
        # and the config hash they were started with come from the session then.
        self.peers = (
            peers if peers is not None else {p.name.encode(): StagePeer(p) for p in plan.processes}
        )
        self.config_hash = config_hash or plan.config_hash
        # When each connected stage was last heard from. Stages that are up already (a
        # session's later job) start with a fresh clock: heartbeats queued between jobs
        # are drained by the recv loop.
        self.seen = PeerTable(
            self.topo.liveness.heartbeat_timeout_s, setting="liveness.heartbeat_timeout_s"
        )
        for ident, peer in self.peers.items():
            if peer.connected:
                self._watch(ident, peer)
        self.secret = secret  # the run's; a Hello without a proof keyed by it is refused
        self.refused = 0  # Hellos refused (no valid proof, unknown stage, already connected)
        self.metrics: list[dict[str, float]] = []
        self.tasks_done = 0
        # A run cut into jobs (training between validations) hands its driver ops on:
        # their state (an adaptive KL coefficient) is the run's, not the job's.
        self._drivers = drivers if drivers is not None else {}
        if not self._drivers:
            self._drivers.update(
                {
                    op.index: resolve_driver_op(
                        op.cfg.op, f"dataflow[{op.index}].op", topology=self.topo, index=op.index
                    )
                    for op in plan.ops
                    if op.stage is None
                }
            )
            if resume_dir:  # driver ops with state (e.g. an adaptive KL coefficient)
                load_drivers(self._drivers, Path(resume_dir))
        # Daemon threads: Ctrl-C/SIGTERM must end the process within seconds even while
        # a driver op or a data source is busy in them (a pool thread would be joined at
        # interpreter exit, however long it runs).
        self._compute = DaemonExecutor("coordinator-compute")
        self._io = DaemonExecutor("coordinator-io")
        self._driver_started: dict[int, tuple[float, Dispatch]] = {}  # monotonic start
        self._fetching: dict[int, float] = {}  # step -> monotonic start of its data batch
        self._first_step = start_step
        self._wake = asyncio.Event()
        self._sink_writes: list[asyncio.Future[Any]] = []
        self._aux: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------------------
    async def run(self) -> RunResult:
        loop = asyncio.get_running_loop()
        self._done: asyncio.Future[None] = loop.create_future()
        self._all_ready: asyncio.Future[None] = loop.create_future()
        t_launch = time.perf_counter()
        self._t_launch_mono = loop.time()
        self._board = StatusBoard(self._status_path())
        up = all(p.ready for p in self.peers.values())  # a session's later job
        loops = [
            self._task(self._recv_loop(), "coordinator.recv"),
            self._task(self._liveness_loop(), "coordinator.liveness"),
        ]
        self.chan.on_bad_message = self._on_bad_message
        try:
            if up:
                self._resume_peers()
            await asyncio.wait([self._all_ready, self._done], return_when=asyncio.FIRST_COMPLETED)
            if self._done.done():
                self._done.result()  # raises the startup error
            startup_s = time.perf_counter() - t_launch
            t0, cpu0 = time.perf_counter(), time.process_time()
            loops.append(self._task(self._dispatch_loop(), "coordinator.dispatch"))
            self._wake.set()
            await self._done
            wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
            await asyncio.gather(*self._sink_writes)
        finally:
            self.chan.on_bad_message = None
            for task in [*loops, *self._aux]:
                task.cancel()
            await asyncio.gather(*loops, *self._aux, return_exceptions=True)
            self._compute.shutdown(wait=False, cancel_futures=True)
            self._io.shutdown(wait=False, cancel_futures=True)
            self._board.close(self._status_doc([]))
        return RunResult(
            run_id=self.run_id,
            metrics=self.metrics,
            events=self.sched.events,
            collected=self.sched.collected,
            startup_s=startup_s,
            wall_s=wall_s,
            coordinator_cpu_s=cpu_s,
            tasks=self.tasks_done,
            checkpoints=self.checkpoints,
        )

    async def shutdown(self, reason: str) -> None:
        """Tell every connected stage to exit. Best effort: a dead peer is skipped."""
        await shutdown_peers(self.chan, self.peers, reason)

    def _resume_peers(self) -> None:
        """A job on processes that are up already: no handshake, and a process that died
        since the last job is a StageDeadError before any task goes out. Heartbeats that
        queued up between jobs are drained by the recv loop; the silence clock restarts."""
        now = asyncio.get_running_loop().time()
        dead = check_liveness(
            self.peers,
            self.launcher.poll(),
            now,
            self.topo.liveness,
            seen=self.seen,
            started_at=now,
            all_ready=True,
        )
        if dead is not None:
            peer, error = dead
            if peer is not None:
                self.chan.forget_peer(peer.ident, peer.pid or None)
            raise error
        self._all_ready.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if not self._done.done():
            self._done.set_exception(exc)

    def _task(self, coro: Any, name: str) -> asyncio.Task[Any]:
        """A named task whose unexpected death ends the run (never a silent hang)."""
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        if not isinstance(exc, HybridflowError):
            log.error("coordinator task %s crashed", task.get_name(), exc_info=exc)
            exc = PipelineError(f"coordinator task {task.get_name()} crashed: {exc!r}")
        self._fail(exc)

    def _spawn(self, coro: Any, name: str) -> None:
        task = self._task(coro, name)
        self._aux.add(task)
        task.add_done_callback(self._aux.discard)

    # -- receiving -----------------------------------------------------------------
    async def _recv_loop(self) -> None:
        try:
            while True:
                rx = await self.chan.recv()
                if not rx.trusted:  # a connection not admitted: only its Hello is read
                    if isinstance(rx.msg, Hello):
                        await self._welcome(rx.peer or b"", rx.msg)
                    else:
                        self._refuse(rx.peer, f"{type(rx.msg).__name__} before an accepted Hello")
                    continue
                peer = self.peers.get(rx.peer or b"")
                if peer is None:
                    log.warning("message from unknown peer %r dropped", rx.peer)
                    continue
                self.seen.seen(rx.peer, rx.msg)
                await self._on_message(peer, rx)
        except HybridflowError as exc:
            self._fail(exc)

    async def _on_message(self, peer: StagePeer, rx: Received) -> None:
        msg = rx.msg
        if isinstance(msg, Result):
            if msg.run_id != self.run_id:
                log.warning("result of run %s dropped (this run is %s)", msg.run_id, self.run_id)
                return
            self.tasks_done += 1
            peer.answered(msg.task_id)
            compute_s = msg.info.get("compute_s", 0.0)
            self.sched.complete(
                msg.task_id,
                peer.info.replica,
                rx.tensors,
                msg.metrics,
                float(compute_s) if isinstance(compute_s, (int, float)) else 0.0,
            )
            self._wake.set()
        elif isinstance(msg, ControlDone):
            waiter = self._control.pop(msg.control_id, None)
            if msg.run_id != self.run_id or waiter is None:
                log.warning("answer to unknown control call %d dropped", msg.control_id)
                return
            peer.answered(-1 - msg.control_id)
            if not waiter.done():
                waiter.set_result(None)
        elif isinstance(msg, Heartbeat):
            peer.progress(msg, asyncio.get_running_loop().time())
            if msg.state.serving and not peer.ready:
                peer.ready = True
                log.info("%s ready", peer.info.name)
                if all(p.ready for p in self.peers.values()) and not self._all_ready.done():
                    self._all_ready.set_result(None)
        elif isinstance(msg, Failure):
            self._fail(self._stage_error(peer, msg))
        elif isinstance(msg, Hello):
            log.debug("%s: repeated Hello ignored", peer.info.name)

    async def _welcome(self, conn: bytes, hello: Hello) -> None:
        """Hello of connection `conn`, not admitted yet (transport/auth.py). Without a
        proof of the run's secret for (run, stage, replica, conn) it is refused and the
        run goes on: whoever sent it cannot fail or stall the run (the refusal is a
        non-blocking reply). With one, it is our stage: the connection is admitted under
        the stage's name, and a config that differs from ours ends the run."""
        name = f"{hello.stage}/{hello.replica}".encode()
        peer = self.peers.get(name)
        if peer is None or not auth.verify(
            self.secret, self.run_id, hello.stage, hello.replica, conn, hello.proof
        ):
            who = name.decode(errors="replace")
            self._refuse(conn, f"Hello as {who} without a valid proof", answer=True)
            return
        if peer.connected:  # the stage's own connection is in already: a replay
            self._refuse(conn, f"second Hello as {peer.info.name}", answer=True)
            return
        info = peer.info
        self.chan.admit(conn, name)
        reason = ""
        if hello.config_hash != self.config_hash:
            reason = (
                f"config hash {hello.config_hash} differs from the coordinator's "
                f"{self.config_hash}; every process must run the same topology"
            )
        await self.chan.send(
            Welcome(run_id=self.run_id, accepted=not reason, reason=reason), to=name
        )
        if reason:
            self._fail(
                PipelineError(f"stage {info.stage} replica {info.replica} rejected: {reason}")
            )
            return
        peer.pid, peer.connected = hello.pid, True
        self._watch(name, peer)

    def _watch(self, ident: bytes, peer: StagePeer) -> None:
        info = peer.info
        self.seen.add(
            ident, label=peer.name(), stage=info.stage, replica=info.replica, pid=peer.pid
        )

    def _refuse(self, conn: bytes | None, why: str, *, answer: bool = False) -> None:
        """Count and log (without flooding) a message of a connection that has not proven
        itself; `answer` a Hello with Welcome(accepted=False), never waiting for it."""
        self.refused += 1
        if self.refused <= 10 or self.refused % 1000 == 0:
            log.warning("refused connection %r: %s (%d refused so far)", conn, why, self.refused)
        if answer and conn is not None:
            self.chan.reply(
                Welcome(run_id=self.run_id, accepted=False, reason="not authenticated"), conn
            )

    def _on_bad_message(self, ident: bytes | None, exc: Exception, msg: Any) -> None:
        """A known, accepted stage sent something undecodable while it had tasks in
        flight: whatever it carried (a Result, a Failure) is lost, so the run would wait
        for it forever. Unknown peers are not ours to judge here (the channel counts them)."""
        peer = self.peers.get(ident or b"")
        if peer is None or not peer.connected or not peer.inflight:
            return
        what = type(msg).__name__ if msg is not None else "message (unreadable header)"
        self._fail(
            StageError(
                f"a {what} from {peer.name()} could not be decoded {peer.doing()}: {exc}; "
                "what it carried is lost, so the run cannot go on",
                **peer.where(),
            )
        )

    def _stage_error(self, peer: StagePeer, f: Failure) -> StageError:
        where = (
            "during setup"
            if f.op == "setup"
            else f"in {f.role}.{f.op} at step {f.step} micro-batch {f.mb_id}"
        )
        return StageError(
            f"stage {f.stage} replica {f.replica} failed {where}: {f.error_type}: {f.message}"
            + oom_hint(self.plan, peer.info, f.error_type),
            stage=f.stage,
            replica=f.replica,
            step=f.step if f.step >= 0 else None,
            mb_id=f.mb_id if f.step >= 0 else None,
            remote_traceback=f.traceback,
        )

    # -- dispatching -----------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                for step in self.sched.data_requests():
                    self._spawn(self._timed_fetch(step), f"coordinator.data.{step}")
                for d in self.sched.ready():
                    if d.op.stage is None:
                        self._spawn(self._run_driver(d), f"coordinator.driver.{d.task_id}")
                    else:
                        await self._send_task(d)
                self._flush_finished()
                if self.sched.done and not self._saving:
                    if not self._done.done():
                        self._done.set_result(None)
                    return
        except HybridflowError as exc:
            self._fail(exc)

    async def _send_task(self, d: Dispatch) -> None:
        op = d.op.cfg
        task = Task(
            run_id=self.run_id,
            task_id=d.task_id,
            step=d.step,
            mb_id=d.mb_id,
            policy_version=d.policy_version,
            role=op.role,
            op=op.op,
            params=dict(op.params),
        )
        bound = self._deadline_of(d)
        for r in d.replicas:
            ident = f"{d.op.stage}/{r}".encode()
            peer = self.peers[ident]
            peer.given(d.task_id, (op.label, d.step, d.mb_id))
            try:
                await self.chan.send(task, d.inputs_for(r), to=ident)
            except PeerDeadError:
                # The process is gone: give the liveness loop a moment to report it with
                # its exit status (a better message than "not connected").
                await asyncio.sleep(0.5)
                raise
            now = asyncio.get_running_loop().time()
            peer.sent(d.task_id, now, bound.seconds, bound.key, note=bound.note)

    def _deadline_of(self, d: Dispatch) -> Bound:
        """The bound of one task of `d`'s op (the table: pipeline/runtime/watch/deadlines.py)."""
        return op_bound(d.op.cfg, d.op.index, self.topo.liveness)

    async def _timed_fetch(self, step: int) -> None:
        """`_fetch`, shown by the waiting report while it runs."""
        self._fetching[step] = time.monotonic()
        try:
            await self._fetch(step)
        finally:
            self._fetching.pop(step, None)

    async def _fetch(self, step: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            batch = await loop.run_in_executor(
                self._io, self.source.batch, step, self.topo.run.step_batch
            )
            self.sched.add_data(step, batch)
        except HybridflowError as exc:
            self._fail(exc)
        except BaseException as exc:  # its own KeyboardInterrupt, SystemExit too: _stopping
            if _stopping(exc):
                raise
            self._fail(
                PipelineError(
                    f"data source {self.topo.data.source!r} failed for step {step}: {exc!r}"
                )
            )
        self._wake.set()

    async def _run_driver(self, d: Dispatch) -> None:
        loop = asyncio.get_running_loop()
        params = dict(d.op.cfg.params, step=d.step, mb_id=d.mb_id, policy_version=d.policy_version)
        t0 = time.perf_counter()
        fn = self._drivers[d.op.index]

        def call() -> Any:  # in the compute thread: the deadline starts when the op does
            self._driver_started[d.task_id] = (time.monotonic(), d)
            try:
                return fn(d.inputs, params)
            finally:
                self._driver_started.pop(d.task_id, None)

        try:
            outputs, metrics = await loop.run_in_executor(self._compute, call)
            self.sched.complete(
                d.task_id, DRIVER_REPLICA, outputs, metrics, time.perf_counter() - t0
            )
            self.tasks_done += 1
        except HybridflowError as exc:
            self._fail(exc)
        except BaseException as exc:  # its own KeyboardInterrupt, SystemExit too: _stopping
            if _stopping(exc):
                raise
            self._fail(
                StageError(
                    f"driver op {d.op.cfg.op} failed at step {d.step} micro-batch {d.mb_id}: "
                    f"{type(exc).__name__}: {exc}",
                    stage="driver",
                    step=d.step,
                    mb_id=d.mb_id,
                    remote_traceback="".join(traceback.format_exception(exc)),
                )
            )
        self._wake.set()

    def _flush_finished(self) -> None:
        loop = asyncio.get_running_loop()
        for step, metrics in self.sched.pop_finished():
            self.metrics.append({"step": float(step), **metrics})
            log.info("step %d done in %.3fs", step, metrics["timing/step"])
            for sink in self.sinks:
                self._sink_writes.append(loop.run_in_executor(self._io, sink.write, step, metrics))
            if self.checkpointer is not None and self.checkpointer.due(step):
                self._saving += 1
                self._spawn(self._checkpoint(step), f"coordinator.checkpoint.{step}")
        for step, rows in self.sched.pop_samples():
            for s in self._sample_sinks:
                write = loop.run_in_executor(self._io, s.write_samples, step, rows, self._tokenizer)
                self._sink_writes.append(write)

    # -- checkpoints -----------------------------------------------------------------
    async def _checkpoint(self, step: int) -> None:
        """Every stage process writes its part, then the directory is committed."""
        ck = self.checkpointer
        assert ck is not None
        loop = asyncio.get_running_loop()
        tmp = await loop.run_in_executor(self._io, ck.begin, step)
        final = step == ck.last_step and ck.cfg.export_final
        waits = []
        call = CheckpointSave(dir=str(tmp), export=str(tmp / "policy") if final else "")
        for ident, peer in self.peers.items():
            control_id = self._next_control
            self._next_control += 1
            fut: asyncio.Future[None] = loop.create_future()
            self._control[control_id] = fut
            waits.append(fut)
            msg = Control(run_id=self.run_id, control_id=control_id, step=step, call=call)
            peer.given(-1 - control_id, ("checkpoint_save", step, -1))
            await self.chan.send(msg, to=ident)
        timeout = self.topo.liveness.control_timeout_s
        answers = asyncio.gather(*waits)
        # A run that fails meanwhile cancels this task; whatever the gather then holds is
        # read here, so asyncio does not log "exception was never retrieved" at teardown.
        answers.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await asyncio.wait_for(answers, timeout)
        except TimeoutError:
            late = [p.info.name for p in self.peers.values() if any(k < 0 for k in p.inflight)]
            raise PipelineError(
                f"checkpoint after step {step}: no answer from {', '.join(late) or 'a stage'} "
                f"within liveness.control_timeout_s = {timeout:g} s (raise it for big models "
                "or slow storage)"
            ) from None
        # The next step is held: no driver op runs while its state is written.
        await loop.run_in_executor(self._io, save_drivers, self._drivers, tmp)
        meta = ck.meta(step, self.plan.topology, self.sched.policy_version)
        try:
            path = await loop.run_in_executor(self._io, ck.commit, tmp, meta)
        except OSError as exc:
            raise PipelineError(f"checkpoint after step {step} not committed: {exc}") from exc
        self.checkpoints.append(str(path))
        log.info("checkpoint after step %d: %s", step, path)
        if step < ck.last_step:
            self.sched.hold = ck.next_due(step + 1) + 1
        self._saving -= 1
        self._wake.set()

    # -- liveness ------------------------------------------------------------------
    async def _liveness_loop(self) -> None:
        live = self.topo.liveness
        tick = min(0.1, live.heartbeat_interval_s / 2)
        loop = asyncio.get_running_loop()
        reporter = Reporter(live.report_interval_s)
        look_every = min(live.heartbeat_interval_s, live.report_interval_s)
        next_look = loop.time() + look_every
        while True:
            await asyncio.sleep(tick)
            if loop.time() >= next_look:  # who waits on whom: log lines, status.json
                next_look = loop.time() + look_every
                found = self._waits()
                for w in reporter.due(found, loop.time()):
                    log.warning("%s", w.line())
                self._board.update(self._status_doc(found))
            dead = check_liveness(
                self.peers,
                self.launcher.poll(),
                loop.time(),
                live,
                seen=self.seen,
                started_at=self._t_launch_mono,
                all_ready=self._all_ready.done(),
            )
            if dead is not None:
                peer, error = dead
                if peer is not None:  # free what the channel holds for it, sweep its shm
                    self.chan.forget_peer(peer.ident, peer.pid or None)
                self._fail(error)
                return
            late = check_deadlines(self.peers, loop.time(), live) or self._driver_late()
            if late is not None:
                self._fail(late)
                return

    def _waits(self) -> list[Wait]:
        """Everything awaited now, longest first (pipeline/runtime/watch/waiting.py)."""
        now, mono, live = asyncio.get_running_loop().time(), time.monotonic(), self.topo.liveness
        found = waiting.waits(self.peers.values(), now, mono, live)
        if not self._all_ready.done():
            found += waiting.startup_waits(self.peers.values(), now, self._t_launch_mono, live)
        for t0, d in list(self._driver_started.values()):
            bound = self._deadline_of(d)
            found.append(waiting.driver_wait(d.op.label, d.step, d.mb_id, mono - t0, bound))
        found += waiting.data_waits(self.topo.data.source, dict(self._fetching), mono)
        return sorted(found, key=lambda w: -w.waited_s)

    def _status_path(self) -> Path | None:
        """status.json beside the run_dir lock this process holds, else None (eval)."""
        from hybridflow.pipeline.runtime.session import run_dir_of  # session imports us

        held = held_here(run_dir_of(self.topo))
        return held / STATUS_FILE if held is not None else None

    def _status_doc(self, found: list[Wait]) -> dict[str, Any]:
        """What status.json says now (pipeline/runtime/watch/status.py); `found`: the waits."""
        state, error = "running", ""
        if self._done.done():
            exc = None if self._done.cancelled() else self._done.exception()
            state, error = ("failed", str(exc).split("\n")[0]) if exc else ("done", "")
        return {
            "pid": os.getpid(),
            "run_id": self.run_id,
            "topology": self.topo.name,
            "updated": time.time(),
            "state": state,
            "error": error,
            "steps": f"{self._first_step}..{self.topo.run.steps - 1}",
            "last_step": int(self.metrics[-1]["step"]) if self.metrics else None,
            "waits": [w.to_json() for w in found],
        }

    def _driver_late(self) -> StageError | None:
        """A driver op running longer than its bound (its thread is abandoned: daemon)."""
        now = time.monotonic()
        for t0, d in list(self._driver_started.values()):
            bound = self._deadline_of(d)
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


async def shutdown_peers(chan: Channel, peers: dict[bytes, StagePeer], reason: str) -> None:
    """Tell every connected stage to exit. Best effort: a dead peer is skipped."""
    for ident, peer in peers.items():
        if not peer.connected:
            continue
        try:
            await chan.send(Shutdown(reason=reason), to=ident, timeout=1.0)
        except HybridflowError as exc:
            log.debug("shutdown to %s not delivered: %s", peer.info.name, exc)


def oom_hint(plan: Plan, process: ProcessInfo, error_type: str) -> str:
    """torch's out-of-memory text names the other processes on the GPU by pid only; for a
    GPU that several stage processes share, name them as stages and say what helps."""
    others = [n for n in plan.shared_gpus().get(process.device, ()) if n != process.name]
    if error_type != "OutOfMemoryError" or not others:
        return ""
    return (
        f" (hint: {process.device} is shared with stage process(es) {', '.join(others)}, each "
        "with its own CUDA allocator: give them their own GPUs, or host their roles in one stage)"
    )

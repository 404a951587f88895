"""The `Coordinator`: one job's loops over the stage processes (the map: __init__.py).

It owns the job's state (the scheduler, the peers, the metrics, the threads that run data
sources, driver ops and sinks) and the loops that move it: receiving, dispatching, the
liveness watch (pipeline/runtime/watch/watchdog.py) and checkpoint rounds. What a
connection must prove before it is heard is admission.py's; the Control calls and
Shutdown it sends every stage, control.py's; the named errors a failure becomes,
failures.py's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridflow.config.dataflow import gang_params
from hybridflow.errors import HybridflowError, PeerDeadError, PipelineError
from hybridflow.pipeline.checkpoint.checkpointer import Checkpointer, load_drivers, save_drivers
from hybridflow.pipeline.driver.registry import resolve_driver_op
from hybridflow.pipeline.observe.metrics import MetricsSink
from hybridflow.pipeline.observe.samples import sample_sinks, samples_wanted
from hybridflow.pipeline.plan.planner import Plan
from hybridflow.pipeline.runtime.coordinator import failures
from hybridflow.pipeline.runtime.coordinator.admission import Gate
from hybridflow.pipeline.runtime.coordinator.control import ControlCalls, shutdown_peers
from hybridflow.pipeline.runtime.coordinator.offload import Offload
from hybridflow.pipeline.runtime.launcher import Launcher
from hybridflow.pipeline.runtime.peers import StagePeer
from hybridflow.pipeline.runtime.scheduler import DRIVER_REPLICA, Dispatch, Event, Scheduler
from hybridflow.pipeline.runtime.watch.deadlines import op_bound
from hybridflow.pipeline.runtime.watch.rundir_lock import held_here
from hybridflow.pipeline.runtime.watch.status import STATUS_FILE, StatusBoard
from hybridflow.pipeline.runtime.watch.waiting import Wait
from hybridflow.pipeline.runtime.watch.watchdog import Watchdog
from hybridflow.pipeline.sources.registry import DataSource
from hybridflow.transport.channel import Channel, Received
from hybridflow.transport.liveness import PeerTable
from hybridflow.transport.protocol import (
    CheckpointSave,
    ControlDone,
    Failure,
    Heartbeat,
    Hello,
    Result,
    Task,
)

log = logging.getLogger("hybridflow.coordinator")


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
        if checkpointer is not None:
            self.sched.hold = checkpointer.next_due(start_step) + 1
        self.metrics: list[dict[str, float]] = []
        self.tasks_done = 0
        self._connect(peers, config_hash or plan.config_hash, secret)
        # A run cut into jobs (training between validations) hands its driver ops on:
        # their state (an adaptive KL coefficient) is the run's, not the job's.
        self._drivers = drivers if drivers is not None else {}
        if not self._drivers:
            self._drivers.update(self._driver_ops(resume_dir))
        self._off = Offload(source, self.topo.data.source, self._drivers)  # the threads
        self._first_step = start_step
        self._wake = asyncio.Event()
        self._sink_writes: list[asyncio.Future[Any]] = []
        self._aux: set[asyncio.Task[Any]] = set()
        self._watchdog = Watchdog(
            peers=self.peers,
            launcher=launcher,
            seen=self.seen,
            chan=channel,
            live=self.topo.liveness,
            data_source=self.topo.data.source,
            drivers=self._off.driver_started,
            fetching=self._off.fetching,
        )

    def _connect(
        self, peers: dict[bytes, StagePeer] | None, config_hash: str, secret: bytes
    ) -> None:
        """The stages' handshake state, their silence clocks and the Hello gate. A
        session's processes outlive one coordinator: their peers and the config hash
        they were started with come from the session then."""
        plan = self.plan
        self.peers = (
            peers if peers is not None else {p.name.encode(): StagePeer(p) for p in plan.processes}
        )
        self.config_hash = config_hash
        # When each connected stage was last heard from. Stages that are up already (a
        # session's later job) start with a fresh clock: heartbeats queued between jobs
        # are drained by the recv loop.
        self.seen = PeerTable(
            self.topo.liveness.heartbeat_timeout_s, setting="liveness.heartbeat_timeout_s"
        )
        self.gate = Gate(
            self.chan,
            self.peers,
            self.seen,
            run_id=self.run_id,
            config_hash=config_hash,
            secret=secret,
        )
        for ident, peer in self.peers.items():
            if peer.connected:
                self.gate.watch(ident, peer)
        self.controls = ControlCalls(self.chan, self.peers, self.run_id)

    def _driver_ops(self, resume_dir: str | None) -> dict[int, Any]:
        """The plan's driver ops (op index -> callable), with their state restored from
        `resume_dir` when they have one (e.g. an adaptive KL coefficient)."""
        topo = self.topo
        drivers = {
            op.index: resolve_driver_op(
                op.cfg.op, f"dataflow[{op.index}].op", topology=topo, index=op.index
            )
            for op in self.plan.ops
            if op.stage is None
        }
        if resume_dir:
            load_drivers(drivers, Path(resume_dir))
        return drivers

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
            self._off.shutdown()
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
        dead = self._watchdog.dead(now, started_at=now, all_ready=True)
        if dead is not None:
            raise dead
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
                        rejected = await self.gate.welcome(rx.peer or b"", rx.msg)
                        if rejected is not None:
                            self._fail(rejected)
                    else:
                        why = f"{type(rx.msg).__name__} before an accepted Hello"
                        self.gate.refuse(rx.peer, why)
                    continue
                peer = self.peers.get(rx.peer or b"")
                if peer is None:
                    log.warning("message from unknown peer %r dropped", rx.peer)
                    continue
                self.seen.seen(rx.peer, rx.msg)
                self._on_message(peer, rx)
        except HybridflowError as exc:
            self._fail(exc)

    def _on_message(self, peer: StagePeer, rx: Received) -> None:
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
                received_bytes=sum(t.nbytes for t in rx.tensors.values()),
            )
            self._wake.set()
        elif isinstance(msg, ControlDone):
            self.controls.answered(peer, msg)
        elif isinstance(msg, Heartbeat):
            peer.progress(msg, asyncio.get_running_loop().time())
            if msg.state.serving and not peer.ready:
                peer.ready = True
                log.info("%s ready", peer.info.name)
                if all(p.ready for p in self.peers.values()) and not self._all_ready.done():
                    self._all_ready.set_result(None)
        elif isinstance(msg, Failure):
            self._fail(failures.stage_failed(self.plan, peer, msg))
        elif isinstance(msg, Hello):
            log.debug("%s: repeated Hello ignored", peer.info.name)

    def _on_bad_message(self, ident: bytes | None, exc: Exception, msg: Any) -> None:
        """A known, accepted stage sent something undecodable while it had tasks in
        flight: whatever it carried (a Result, a Failure) is lost, so the run would wait
        for it forever. Unknown peers are not ours to judge here (the channel counts them)."""
        peer = self.peers.get(ident or b"")
        if peer is None or not peer.connected or not peer.inflight:
            return
        self._fail(failures.undecodable(peer, exc, msg))

    # -- dispatching -----------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                for step in self.sched.data_requests():
                    self._spawn(self._fetch(step), f"coordinator.data.{step}")
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
            params=dict(op.params) | gang_params(d.gang),
            returns=d.returns(),
        )
        # The bound of one task of the op (the table: pipeline/runtime/watch/deadlines.py).
        bound = op_bound(op, d.op.index, self.topo.liveness)
        for r in d.replicas:
            ident = f"{d.op.stage}/{r}".encode()
            peer = self.peers[ident]
            peer.given(d.task_id, (op.label, d.step, d.mb_id))
            inputs = d.inputs_for(r)
            t0 = time.perf_counter()
            try:
                await self.chan.send(task, inputs, to=ident)
            except PeerDeadError:
                # The process is gone: give the liveness loop a moment to report it with
                # its exit status (a better message than "not connected").
                await asyncio.sleep(0.5)
                raise
            sent_s = time.perf_counter() - t0
            self.sched.sent(d.step, sum(t.nbytes for t in inputs.values()), sent_s)
            now = asyncio.get_running_loop().time()
            peer.sent(d.task_id, now, bound.seconds, bound.key, note=bound.note)

    async def _fetch(self, step: int) -> None:
        try:
            self.sched.add_data(step, await self._off.batch(step, self.topo.run.step_batch))
        except HybridflowError as exc:
            self._fail(exc)
        self._wake.set()

    async def _run_driver(self, d: Dispatch) -> None:
        t0 = time.perf_counter()
        try:
            outputs, metrics = await self._off.drive(d)
            self.sched.complete(
                d.task_id, DRIVER_REPLICA, outputs, metrics, time.perf_counter() - t0
            )
            self.tasks_done += 1
        except HybridflowError as exc:
            self._fail(exc)
        self._wake.set()

    def _flush_finished(self) -> None:
        for step, metrics in self.sched.pop_finished():
            self.metrics.append({"step": float(step), **metrics})
            log.info("step %d done in %.3fs", step, metrics["timing/step"])
            for sink in self.sinks:
                self._sink_writes.append(self._off.io_call(sink.write, step, metrics))
            if self.checkpointer is not None and self.checkpointer.due(step):
                self._saving += 1
                self._spawn(self._checkpoint(step), f"coordinator.checkpoint.{step}")
        for step, rows in self.sched.pop_samples():
            for s in self._sample_sinks:
                write = self._off.io_call(s.write_samples, step, rows, self._tokenizer)
                self._sink_writes.append(write)

    # -- checkpoints -----------------------------------------------------------------
    async def _checkpoint(self, step: int) -> None:
        """Every stage process writes its part, then the directory is committed."""
        ck = self.checkpointer
        assert ck is not None
        tmp = await self._off.io_call(ck.begin, step)
        final = step == ck.last_step and ck.cfg.export_final
        await self.controls.call_all(
            CheckpointSave(dir=str(tmp), export=str(tmp / "policy") if final else ""),
            step=step,
            label="checkpoint_save",
            timeout=self.topo.liveness.control_timeout_s,
            what=f"checkpoint after step {step}",
            hint="raise it for big models or slow storage",
        )
        # The next step is held: no driver op runs while its state is written.
        await self._off.io_call(save_drivers, self._drivers, tmp)
        meta = ck.meta(step, self.plan.topology, self.sched.policy_version)
        try:
            path = await self._off.io_call(ck.commit, tmp, meta)
        except OSError as exc:
            raise PipelineError(f"checkpoint after step {step} not committed: {exc}") from exc
        self.checkpoints.append(str(path))
        log.info("checkpoint after step %d: %s", step, path)
        if step < ck.last_step:
            self.sched.hold = ck.next_due(step + 1) + 1
        self._saving -= 1
        self._wake.set()

    # -- liveness and status ---------------------------------------------------------
    async def _liveness_loop(self) -> None:
        self._fail(await self._watchdog.run(self._t_launch_mono, self._all_ready, self._report))

    def _report(self, found: list[Wait]) -> None:
        self._board.update(self._status_doc(found))

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

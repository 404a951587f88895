"""A session: the stage processes of one topology, kept up across jobs until `close()`.

    Session(launch plan)          nothing runs yet; the event loop, run id and ipc dir exist
      .run_job(plan of job 1)     bind the ROUTER, launch one process per stage replica
                                  (what each is started with: stage_specs.py),
                                  handshake (every process is checked against the LAUNCH
                                  plan's config hash), then coordinate the job's steps
      .run_job(plan of job 2)     same processes, same socket and peers; a new Coordinator
                                  (and scheduler, data source, metrics sinks) per job
      .close()                    Shutdown to every stage -> close the socket ->
                                  launcher.stop (wait, TERM, KILL, reap) -> sweep
                                  /dev/shm/hybridflow-<run_id>-* -> remove the ipc dir

A job is a number of steps of one dataflow: the set of ops it sends. Stage processes do
not learn a job's dataflow; they run whatever Task arrives, and their roles keep their
state (weights, optimizer, RNG) from one job to the next. So a job may use any subset of
the launched processes and any ops of their roles, under `mismatch()`: the job's topology
must have the launch topology's processes (stages, seed, transport, liveness, log level)
and each `reshard` it sends must be linked as at launch (a stage-to-stage weight link is
set up once, at process start: pipeline/host/weight_sync.py). One consequence for
callers: launch the topology whose dataflow is the union of what the jobs will send (for
the Engine: the training topology) and let each job send a subset of it.

Errors: a job that raises (a stage failed or died, a timeout, Ctrl-C, SIGTERM) closes
the session: its processes may hold half a step, so nothing may run on them any more.
A process that died between jobs is reported by the next `run_job` as a StageDeadError
before any task is sent.

Invariants: the processes of a session never outlive it: `close()` is idempotent, a
session dropped without `close()` is torn down by a `weakref.finalize` (at garbage
collection or interpreter exit), and each child dies with this process anyway
(PR_SET_PDEATHSIG + its parent watch, see launcher.py). After `close()` no process,
shared-memory segment or ipc directory of the session is left. One job at a time; jobs
run on this thread's event loop (an `asyncio.Runner` kept for the session's life time).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import shutil
import signal
import socket
import threading
import uuid
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.config.loader import to_dict
from hybridflow.config.schema import Topology
from hybridflow.errors import PipelineError
from hybridflow.pipeline.checkpoint.checkpointer import Checkpointer
from hybridflow.pipeline.observe.metrics import MetricsSink, make_sinks
from hybridflow.pipeline.plan.planner import Plan
from hybridflow.pipeline.plan.weight_links import describe_links
from hybridflow.pipeline.runtime.coordinator import Coordinator, RunResult, shutdown_peers
from hybridflow.pipeline.runtime.launcher import Launcher, LocalLauncher, ProcessExit
from hybridflow.pipeline.runtime.peers import StagePeer
from hybridflow.pipeline.runtime.stage_specs import (
    ipc_dir,
    place_on_hosts,
    places_hosts,
    stage_specs,
)
from hybridflow.pipeline.sources.registry import DataSource, create_source
from hybridflow.transport import aio, auth, curve, shm
from hybridflow.transport.channel import Channel

log = logging.getLogger("hybridflow.session")


class SessionState(enum.Enum):
    NEW = "new"  # nothing launched yet (the first job launches)
    UP = "up"  # processes launched; between jobs or running one
    CLOSED = "closed"  # torn down (close(), a failed job, or the finalizer)


def run_dir_of(topo: Topology) -> Path:
    return Path(topo.run_dir or os.path.join("runs", topo.name))


@dataclass
class _Live:
    """Everything the teardown needs, apart from the Session object so that a
    `weakref.finalize` can release it without keeping the Session alive."""

    run_id: str
    launcher: Launcher
    runner: asyncio.Runner
    ipc_dir: str | None
    shutdown_timeout_s: float
    secret: bytes = field(default=b"", repr=False)  # proves a stage is ours (auth.py)
    curve: curve.RunKeys | None = field(default=None, repr=False)  # off loopback (curve.py)
    chan: Channel | None = None
    peers: dict[bytes, StagePeer] = field(default_factory=dict)
    exits: list[ProcessExit] = field(default_factory=list)
    closed: bool = False

    def release(self, reason: str) -> None:
        """Idempotent teardown, in the order of the module docstring."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.chan is not None and _no_running_loop():
                with contextlib.suppress(Exception):
                    self.runner.run(shutdown_peers(self.chan, self.peers, reason))
        finally:
            try:
                if self.chan is not None:
                    self.chan.close()
            finally:
                self.exits = self.launcher.stop(self.shutdown_timeout_s)
                leaked = shm.sweep(self.run_id)
                if leaked:
                    log.debug("swept %d shm segment(s) of run %s", len(leaked), self.run_id)
                if self.ipc_dir:
                    shutil.rmtree(self.ipc_dir, ignore_errors=True)
                with contextlib.suppress(Exception):
                    self.runner.close()


class Session:
    """Stage processes of `plan` (launched by the first job) and the jobs run on them."""

    def __init__(
        self,
        plan: Plan,
        *,
        launcher: Launcher | None = None,
        run_id: str | None = None,
        resume_dir: str | None = None,
    ) -> None:
        self.plan = plan  # the launch plan: what the processes were started with
        self.topo = plan.topology
        launcher = launcher or LocalLauncher()
        place_on_hosts(plan, launcher)
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.resume_dir = resume_dir  # checkpoint the stages restore right after setup
        self.state = SessionState.NEW
        self.jobs = 0  # jobs started
        self._live = _Live(
            run_id=self.run_id,
            launcher=launcher,
            runner=asyncio.Runner(loop_factory=aio.loop_factory()),
            ipc_dir=ipc_dir(self.topo, self.run_id),
            shutdown_timeout_s=self.topo.liveness.shutdown_timeout_s,
            secret=auth.new_secret(),
            peers={p.name.encode(): StagePeer(p) for p in plan.processes},
            # Sockets bound off loopback: CurveZMQ with keys of this run only.
            curve=curve.RunKeys.new([p.name for p in plan.processes], self.run_id)
            if curve.needed(self.topo.transport.protocol, self.topo.transport.host)
            else None,
        )
        # Never leak a process: release on garbage collection / interpreter exit too.
        self._finalizer = weakref.finalize(
            self, _Live.release, self._live, "session dropped without close()"
        )

    # ------------------------------------------------------------------------------
    @property
    def launcher(self) -> Launcher:
        return self._live.launcher

    @property
    def alive(self) -> bool:
        return self.state is not SessionState.CLOSED

    def pids(self) -> dict[str, int]:
        """Process name ("engine/0") -> pid, while the processes are up."""
        return self._live.launcher.pids() if self.state is SessionState.UP else {}

    def mismatch(self, topo: Topology) -> str:
        """ "" if a job of `topo` can run on this session's processes, else why not."""
        if not self.alive:
            return "the session is closed"
        ours, theirs = _processes_of(self.topo), _processes_of(topo)
        for key in ours:
            if ours[key] != theirs[key]:
                return f"its {key} differ from the ones the processes were started with"
        resharding = {op.role for op in topo.dataflow if op.op == "reshard"}
        if _links(self.topo, resharding) != _links(topo, resharding):
            return "its weight links differ from the ones set up at process start"
        return ""

    def run_job(
        self,
        plan: Plan,
        *,
        collect: Sequence[str] = (),
        sinks: Sequence[MetricsSink] | None = None,
        start_step: int = 0,
        checkpointer: Checkpointer | None = None,
        driver_state: str | None = None,
        source: DataSource | None = None,
        drivers: dict[int, Any] | None = None,
    ) -> RunResult:
        """Run steps `start_step` .. `plan.topology.run.steps - 1` of `plan`'s dataflow on
        this session's processes (launching them first if this is the first job).
        `driver_state`: checkpoint to load the coordinator-side driver ops' state from.
        Metrics go to `sinks` when given (the caller's: left open, so several jobs can
        write one run's files), else to the topology's own, closed when the job ends.
        `source`: a data source the caller built (and closes), else the topology's,
        built for this job. `drivers`: the driver ops of an earlier job of the same
        dataflow, whose state (an adaptive KL coefficient) carries on; an empty dict is
        filled with this job's. Raises HybridflowError; any error (or Ctrl-C) closes the
        session."""
        why = self.mismatch(plan.topology)
        if why:
            raise PipelineError(f"job {plan.topology.name!r} cannot run on this session: {why}")
        topo = plan.topology
        own = sinks is None
        all_sinks = (
            make_sinks(topo.metrics.backends, run_dir_of(topo), topo, start_step)
            if own
            else list(sinks or ())
        )
        self.jobs += 1
        ok = False
        try:
            terminated: list[bool] = []
            try:
                result = self._live.runner.run(
                    self._job(
                        plan,
                        all_sinks,
                        tuple(collect),
                        terminated,
                        start_step,
                        checkpointer,
                        driver_state,
                        source,
                        drivers,
                    )
                )
            except asyncio.CancelledError:
                if terminated:  # SIGTERM: reported like Ctrl-C (the CLI exits 130)
                    raise KeyboardInterrupt("SIGTERM") from None
                raise
            ok = True
        finally:
            for sink in all_sinks if own else ():
                with contextlib.suppress(Exception):
                    sink.close()
            if not ok:
                self.close("job failed")
        return result

    def close(self, reason: str = "session closed") -> list[ProcessExit]:
        """Stop every process (idempotent); -> how each one exited."""
        self.state = SessionState.CLOSED
        self._finalizer.detach()
        self._live.release(reason)
        return list(self._live.exits)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------
    async def _job(
        self,
        plan: Plan,
        sinks: list[MetricsSink],
        collect: tuple[str, ...],
        terminated: list[bool],
        start_step: int,
        checkpointer: Checkpointer | None,
        driver_state: str | None,
        given_source: DataSource | None,
        drivers: dict[int, Any] | None,
    ) -> RunResult:
        live = self._live
        launch = live.chan is None
        if live.chan is None:
            live.chan = self._bind()
        chan = live.chan
        source = given_source or create_source(plan.topology.data, plan.topology.seed)
        coord = Coordinator(
            plan,
            chan,
            live.launcher,
            source,
            sinks,
            run_id=self.run_id,
            collect=collect,
            start_step=start_step,
            checkpointer=checkpointer,
            resume_dir=driver_state,
            peers=live.peers,
            config_hash=self.plan.config_hash,
            secret=live.secret,
            drivers=drivers,
        )
        try:
            with _cancel_on_sigterm(terminated):
                if launch:
                    self._launch(chan.endpoint)
                return await coord.run()
        finally:
            if given_source is None:
                source.close()

    def _bind(self) -> Channel:
        """The coordinator's ROUTER socket, bound (the first job's; later jobs reuse it)."""
        live, t = self._live, self.topo.transport
        endpoint = f"ipc://{live.ipc_dir}/coordinator" if live.ipc_dir else f"tcp://{t.host}:0"
        return Channel(
            "router",
            endpoint,
            bind=True,
            gated=True,  # nothing of a stage is acted on before its Hello proof
            name="coordinator",
            run_id=self.run_id,
            hwm=t.hwm,
            shm_threshold=t.shm_threshold,
            curve_keys=live.curve.for_server() if live.curve is not None else None,
        )

    def _launch(self, endpoint: str) -> None:
        """One process per stage replica of the launch plan (stage_specs.py)."""
        live = self._live
        self.state = SessionState.UP
        listeners: list[socket.socket] = []
        try:
            live.launcher.start(
                stage_specs(
                    self.plan,
                    self.run_id,
                    endpoint,
                    self.resume_dir,
                    run_dir=run_dir_of(self.plan.topology),
                    secret=live.secret,
                    listeners=listeners,
                    curve_keys=live.curve,
                    bind_rendezvous=not places_hosts(live.launcher),
                )
            )
        finally:  # the sending processes hold their own copies now
            for sock in listeners:
                sock.close()


# ---------------------------------------------------------------------------------------


def _processes_of(topo: Topology) -> dict[str, Any]:
    """What the stage processes were built from (all but the dataflow, data and sizes)."""
    return {
        "stages": to_dict(topo.stages),
        "seed": topo.seed,
        "transport": to_dict(topo.transport),
        "liveness": to_dict(topo.liveness),
        "log level": topo.log_level,
    }


def _links(topo: Topology, roles: set[str]) -> list[Any]:
    """The stage-to-stage weight links of `topo` that start at one of `roles`."""
    return [link for link in describe_links(topo) if str(link["from"]).split(" ", 1)[0] in roles]


def _no_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return True
    return False


@contextlib.contextmanager
def _cancel_on_sigterm(terminated: list[bool]) -> Iterator[None]:
    """While a job runs, SIGTERM takes the same teardown path as Ctrl-C (asyncio.Runner
    handles SIGINT). Between jobs SIGTERM keeps its default action."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()

    def on_term() -> None:
        terminated.append(True)
        if task is not None:
            task.cancel()

    installed = False
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGTERM, on_term)
        installed = True
    try:
        yield
    finally:
        if installed:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGTERM)

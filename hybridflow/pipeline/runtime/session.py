"""A session: the stage processes of one topology, kept up across jobs until `close()`.

    Session(launch plan)          nothing runs yet; the event loop, run id and ipc dir exist
      .run_job(plan of job 1)     bind the ROUTER, launch one process per stage replica,
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
import copy
import enum
import logging
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import threading
import uuid
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.config.loader import to_dict
from hybridflow.config.schema import Topology
from hybridflow.errors import ConfigError, PipelineError
from hybridflow.pipeline.checkpoint.checkpointer import Checkpointer
from hybridflow.pipeline.host.weight_sync import endpoints
from hybridflow.pipeline.observe.metrics import MetricsSink, make_sinks
from hybridflow.pipeline.plan.planner import Plan
from hybridflow.pipeline.plan.weight_links import describe_links
from hybridflow.pipeline.runtime.coordinator import Coordinator, RunResult, shutdown_peers
from hybridflow.pipeline.runtime.launcher import (
    LAUNCHER_RENDEZVOUS,
    Launcher,
    LocalLauncher,
    ProcessExit,
    ProcessSpec,
)
from hybridflow.pipeline.runtime.peers import StagePeer
from hybridflow.pipeline.sources.registry import DataSource, create_source
from hybridflow.transport import aio, auth, curve, shm
from hybridflow.transport.channel import Channel
from hybridflow.transport.liveness import pid_alive

log = logging.getLogger("hybridflow.session")

STAGE_ENTRY = "hybridflow.pipeline.host.stage_process:main"


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


def places_hosts(launcher: object) -> bool:
    """Whether `launcher` puts processes on named hosts (a multi-host launcher)."""
    return callable(getattr(launcher, "assign_nodes", None))


def place_on_hosts(plan: Plan, launcher: object) -> None:
    """Hand the plan's process -> host map (`stages.<s>.hosts`) to a multi-host launcher;
    a host name with a launcher that only starts local processes is a ConfigError."""
    nodes = plan.nodes()
    if places_hosts(launcher):
        launcher.assign_nodes(nodes)  # type: ignore[attr-defined]
        return
    if nodes:
        name, host = next(iter(nodes.items()))
        raise ConfigError(
            f"stages.{name.split('/')[0]}.hosts",
            f"puts {name} on host {host!r}: processes on other hosts need a multi-host "
            "launcher (hybridflow run --launcher ray); drop the host to run here",
        )


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
            ipc_dir=_ipc_dir(self.topo, self.run_id),
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
        if launch:
            t = self.topo.transport
            endpoint = f"ipc://{live.ipc_dir}/coordinator" if live.ipc_dir else f"tcp://{t.host}:0"
            live.chan = Channel(
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
        source = given_source or create_source(plan.topology.data, plan.topology.seed)
        coord = Coordinator(
            plan,
            live.chan,
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
                    self.state = SessionState.UP
                    listeners: list[socket.socket] = []
                    try:
                        live.launcher.start(
                            _specs(
                                self.plan,
                                self.run_id,
                                live.chan.endpoint,
                                self.resume_dir,
                                secret=live.secret,
                                listeners=listeners,
                                curve_keys=live.curve,
                                bind_rendezvous=not places_hosts(live.launcher),
                            )
                        )
                    finally:  # the sending processes hold their own copies now
                        for sock in listeners:
                            sock.close()
                return await coord.run()
        finally:
            if given_source is None:
                source.close()


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


def _specs(
    plan: Plan,
    run_id: str,
    endpoint: str,
    resume_dir: str | None = None,
    *,
    secret: bytes,
    listeners: list[socket.socket],
    curve_keys: curve.RunKeys | None = None,
    bind_rendezvous: bool = True,
) -> list[ProcessSpec]:
    """One spec per stage replica. `secret` (and each process's CurveZMQ keys) travels
    in the payload (the launcher's stdin pipe: never argv, env or a file). Listening sockets for the weight links are appended
    to `listeners`: close them once the processes started (they inherited theirs)."""
    topo_data = to_dict(plan.topology)
    host = plan.topology.transport.host
    # Replicas of one stage are ranks of one group (FSDP): give them a rendezvous address
    # so roles never pick ports themselves. Its socket is bound here and kept listening;
    # replica 0 inherits it and its TCPStore adopts it (`init_listen_fd`), so no other
    # process can take the port in between (no bind-close-rebind).
    # A multi-host launcher binds it on rank 0's node instead (`bind_rendezvous=False`).
    init: dict[str, tuple[str, int]] = {}
    for stage, n in plan.replicas.items():
        if n > 1 and not bind_rendezvous:
            init[stage] = (LAUNCHER_RENDEZVOUS, -1)
        elif n > 1:
            sock = socket.create_server((host, 0), backlog=128)
            listeners.append(sock)
            init[stage] = (f"tcp://{host}:{sock.getsockname()[1]}", sock.fileno())
    # Stage-to-stage weight links (disaggregated reshard): one endpoint per sending role.
    weight_sync = endpoints(plan.topology, endpoint, listeners)
    specs = []
    for p in plan.processes:
        links: dict[str, dict[str, Any]] = {}
        fds: list[int] = []
        for source, spec in weight_sync.items():
            mine = spec["stage"] == p.stage and p.replica == 0  # the sending replica
            links[source] = {k: v for k, v in spec.items() if mine or not k.endswith("_fd")}
            fds += [v for k, v in spec.items() if mine and k.endswith("_fd")]
        init_method, init_fd = init.get(p.stage, ("", -1))
        if p.replica == 0 and init_fd >= 0:
            fds.append(init_fd)
        payload = {
            "topology": copy.deepcopy(topo_data),  # each its own: launchers may edit
            "stage": p.stage,
            "replica": p.replica,
            "endpoint": endpoint,
            "run_id": run_id,
            "run_dir": str(run_dir_of(plan.topology)),
            "parent_pid": os.getpid(),
            "init_method": init_method,
            "init_listen_fd": init_fd if p.replica == 0 else -1,
            "resume_dir": resume_dir or "",
            "weight_sync": links,
            "secret": secret.hex(),
        }
        if curve_keys is not None:  # the child's bootstrap installs and removes them
            payload["curve"] = curve_keys.for_process(p.name).to_payload()
        specs.append(
            ProcessSpec(
                name=p.name,
                target=STAGE_ENTRY,
                payload=payload,
                title=f"hf-{p.stage}-{p.replica}",
                pass_fds=tuple(fds),
            )
        )
    return specs


def _ipc_dir(topo: Topology, run_id: str) -> str | None:
    if topo.transport.protocol != "ipc":
        return None
    base = topo.transport.ipc_dir or None
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
    sweep_stale_ipc_dirs(base)
    # The owner's pid is in the name: a coordinator killed with SIGKILL cannot remove its
    # directory, the next session (here) does once that pid is gone.
    return tempfile.mkdtemp(prefix=f"hf-{run_id[:8]}-p{os.getpid()}-", dir=base)


_IPC_DIR_NAME = re.compile(r"^hf-[0-9A-Za-z_]{1,8}-p(\d+)-[0-9A-Za-z_]+$")


def sweep_stale_ipc_dirs(base: str | None = None) -> list[str]:
    """Remove the ipc directories (`hf-<run>-p<pid>-*`, ours only) whose coordinator pid is
    no longer running; never one of a live process. -> the paths removed."""
    base = base or tempfile.gettempdir()
    removed = []
    try:
        entries = os.listdir(base)
    except OSError:
        return removed
    for entry in entries:
        m = _IPC_DIR_NAME.match(entry)
        if m is None or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(base, entry)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.info("removed stale ipc directory %s (pid %s is gone)", path, m.group(1))
    return removed


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

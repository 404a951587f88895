"""One stage replica: an OS process hosting one or more roles, driven by the coordinator.

Life cycle (`StageState`):
  CONNECTING  DEALER connects to the coordinator's ROUTER as `<stage>/<replica>#<random>`;
              Hello(stage, replica, pid, roles, config hash, schema version, proof: HMAC
              of the run secret, transport/auth.py) -> Welcome within startup_timeout_s
  SETUP       roles built and set up in the worker thread while heartbeats go on
              (setup.py: model loading may take minutes)
  READY       Tasks and Control calls started in arrival order by the op declarations of
              the roles (tasks.py); the heartbeat reports BUSY while any runs
  STOPPING    Shutdown received (or the parent died): roles closed, sockets closed, exit

The process in three files: this one is its life (the launch spec, the socket, the loops
and their supervision, teardown); setup.py builds the roles; tasks.py runs what the
coordinator asks; worker.py is the one thread role code runs in; failures.py turns errors
into `Failure` messages.

Concurrency: the asyncio loop owns the socket (receive, heartbeat, send). Four loops live
as long as the process: receive, work (tasks.py), heartbeat and parent watch. They are
supervised together (`_supervise`): one that dies is a Failure naming the stage and the
loop, then a stop (exit 1), at once, never a process heartbeating on while its tasks sit
queued. The task queue is bounded by run.max_inflight (the coordinator's own bound). A
task, control call or setup that raises anything (any BaseException, except this
process's own teardown: failures.interrupted) becomes a Failure naming the stage, the op
or call and the cause, with the traceback text; the process keeps serving until the
coordinator says Shutdown.

Seeds: before any role exists, the process's global RNGs (torch, Python, NumPy) are
seeded from (run seed, stage, replica), so code that draws from them is reproducible.
Checkpoints (pipeline/checkpoint/): the control call `CheckpointSave` (a `Control`
message, never a role's Task) is answered by the process itself (every role's state_dict
+ RNG written to the given directory); a spec with `resume_dir` restores roles and RNG
right after setup. Log lines carry stage/replica and the step of the task being run.
Disaggregated reshard (weight_sync.py): when the topology links an actor's `reshard` to a
`load_weights` in another stage, the process answers those two ops itself: weights stream
stage to stage over the endpoints in the spec's `weight_sync`.

Exit codes: 0 after Shutdown, 3 handshake rejected, 4 coordinator unreachable/gone,
1 an unexpected exception or a dead loop of the process (logged).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from hybridflow.config.loader import config_hash, from_dict
from hybridflow.config.schema import Topology
from hybridflow.errors import HybridflowError, PipelineError
from hybridflow.pipeline.checkpoint import stage as checkpoint
from hybridflow.pipeline.host import launch_spec
from hybridflow.pipeline.host.failures import CONTROL, LOOP, failure, interrupted
from hybridflow.pipeline.host.launch_spec import LaunchSpec
from hybridflow.pipeline.host.setup import SetupFailed, set_up
from hybridflow.pipeline.host.tasks import TaskRunner, add_step
from hybridflow.pipeline.host.weight_sync import StageWeightSync
from hybridflow.pipeline.host.worker import Worker
from hybridflow.stages.base import Role
from hybridflow.transport import aio, auth
from hybridflow.transport.channel import Channel, Received
from hybridflow.transport.liveness import Heartbeater
from hybridflow.transport.protocol import (
    Control,
    Failure,
    Hello,
    Msg,
    Shutdown,
    StageState,
    Task,
    Welcome,
)

log = logging.getLogger("hybridflow.stage")


def main(payload: dict[str, Any]) -> int:
    """Entry point in the child (called by the launcher's bootstrap with plain data)."""
    spec, secret = launch_spec.decode(payload)
    topo = from_dict(Topology, spec.topology)  # decoded once, here
    stage, replica = spec.stage, spec.replica
    logging.basicConfig(
        level=topo.log_level,
        format=f"%(asctime)s %(levelname)s [{stage}/{replica} step %(step)s] %(name)s: %(message)s",
        force=True,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(add_step)
    checkpoint.seed_process(checkpoint.derive_seed(topo.seed, stage, replica))
    proc = StageProcess(spec, topo, secret)
    code = aio.run(proc.run())
    if proc.worker_stuck:
        # The launcher's bootstrap leaves with os._exit, so a stuck worker thread does not
        # keep the process alive; say that it was abandoned.
        log.warning("worker thread still busy at exit; abandoning it")
    return code


class StageProcess:
    def __init__(self, spec: LaunchSpec, topo: Topology, secret: bytes) -> None:
        self.spec, self.topo = spec, topo
        self.stage, self.replica = spec.stage, spec.replica
        self.cfg = topo.stages[spec.stage]
        # The run's secret (stdin JSON only: never argv, env or a file) proves this process
        # to the coordinator and to weight-link peers (transport/auth.py).
        self._secret = secret
        self.identity = auth.connection_identity(f"{self.stage}/{self.replica}")
        self.weight_sync: StageWeightSync | None = None
        self.config_hash = config_hash(topo)
        self.state = StageState.CONNECTING
        self.roles: dict[str, Role] = {}
        self.worker_stuck = False
        self.worker = Worker(f"{self.stage}-{self.replica}")
        self.tasks: TaskRunner | None = None  # once set up
        # Tasks received and not started, bounded: the coordinator keeps at most
        # run.max_inflight tasks out per replica, and one Control call at a time.
        self._queue: asyncio.Queue[Received] = asyncio.Queue(topo.run.max_inflight + 1)
        self._stop = asyncio.Event()
        self._reports: set[asyncio.Task[None]] = set()  # Failures sent from callbacks
        self._crashed = False  # a loop of the process died: exit 1 (the coordinator names it)

    # ------------------------------------------------------------------------------
    async def run(self) -> int:
        t = self.topo.transport
        self.chan = Channel(
            "dealer",
            self.spec.endpoint,
            bind=False,
            name=f"stage {self.stage}/{self.replica}",
            run_id=self.spec.run_id,
            identity=self.identity,
            hwm=t.hwm,
            shm_threshold=t.shm_threshold,
        )
        self.chan.on_bad_message = self._on_bad_message
        loops: list[asyncio.Task[Any]] = []
        try:
            code = await self._handshake()
            if code:
                return code
            self.state = StageState.SETUP
            # Heartbeats never block: one the socket cannot take now is skipped, and the
            # silence is what the coordinator detects.
            self.heartbeat = Heartbeater(
                self.chan,
                stage=self.stage,
                replica=self.replica,
                interval_s=self.topo.liveness.heartbeat_interval_s,
                state=self._state_name,
                progress=self.worker.progress,
            )
            loops.append(self._supervise(self.heartbeat.start(), "heartbeat"))
            loops.append(self._supervise(self._watch_parent(), "parent watch"))
            loops.append(self._supervise(self._recv_loop(), "receive"))
            # Setup may take minutes (model loading): a Shutdown meanwhile must not wait.
            setup = asyncio.create_task(self._setup(), name="stage.setup")
            stop = asyncio.create_task(self._stop.wait(), name="stage.stop")
            loops += [setup, stop]
            await asyncio.wait([setup, stop], return_when=asyncio.FIRST_COMPLETED)
            if setup.done() and setup.result() is not None:
                self.tasks = setup.result()
                self.state = StageState.READY
                self.heartbeat.beat()  # tell the coordinator at once, not one interval later
                loops.append(self._supervise(self.tasks.work_loop(self._queue), "work"))
            elif setup.done():
                self.state = StageState.FAILED
            await self._stop.wait()
            if self._crashed:
                return 1
            return 0 if self.parent_alive() else 4
        finally:
            self.state = StageState.STOPPING
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await self._close_roles()
            if self.weight_sync is not None:
                await self.weight_sync.close()
            self.chan.close()

    def _supervise(self, loop: Any, name: str) -> asyncio.Task[Any]:
        """Run one of the process's loops (`loop`: a coroutine or a started task) under
        supervision. A loop lives as long as the process; one that ends while the process
        is not stopping (an error: a bug in the runtime, not a role's, those are Failures;
        or a return) leaves nobody to do its job, so the process reports a Failure naming
        the stage and the loop (`role` LOOP, `op` the loop's name) and stops, exit 1. The
        coordinator ends the run with that error at once, rather than the process
        heartbeating on while its tasks sit queued."""
        task = loop if isinstance(loop, asyncio.Task) else asyncio.create_task(loop)
        task.set_name(f"stage.{name}")
        task.add_done_callback(lambda t: self._loop_done(t, name))
        return task

    def _loop_done(self, task: asyncio.Task[Any], name: str) -> None:
        if task.cancelled() or self._stop.is_set():
            return  # teardown, or a loop that ended because the process is stopping
        exc = task.exception() or RuntimeError(f"the {name} loop returned")
        log.error("the %s loop died; stopping", name, exc_info=exc)
        self._crashed = True
        dead = self._failure(-1, -1, -1, LOOP, name, exc)

        async def report_and_stop() -> None:
            try:  # bounded: _send's timeout; if even this fails, exit 1 says enough
                await self._send_failure(dead)
            finally:
                self._stop.set()

        self._report(report_and_stop(), "stage.dead")

    def _report(self, coro: Any, name: str) -> None:
        """Send a Failure from a callback (no awaiting caller): kept until it is sent."""
        report = asyncio.get_running_loop().create_task(coro, name=name)
        self._reports.add(report)
        report.add_done_callback(self._reports.discard)

    async def _handshake(self) -> int:
        hello = Hello(
            stage=self.stage,
            replica=self.replica,
            pid=os.getpid(),
            roles=list(self.cfg.roles),
            config_hash=self.config_hash,
            proof=auth.proof(
                self._secret, self.spec.run_id, self.stage, self.replica, self.identity
            ),
        )
        timeout = self.topo.liveness.startup_timeout_s
        await self.chan.send(hello, timeout=timeout, timeout_setting="liveness.startup_timeout_s")
        deadline = time.monotonic() + timeout
        while True:
            try:
                rx = await self.chan.recv(
                    timeout=max(0.0, deadline - time.monotonic()),
                    timeout_setting="liveness.startup_timeout_s",
                )
            except HybridflowError as exc:
                log.error("no Welcome from the coordinator: %s", exc)
                return 4
            if isinstance(rx.msg, Welcome):
                if not rx.msg.accepted:
                    log.error("coordinator rejected this stage: %s", rx.msg.reason)
                    return 3
                return 0
            if isinstance(rx.msg, Shutdown):
                return 4

    async def _setup(self) -> TaskRunner | None:
        """Set up (setup.py); -> what runs the tasks, or None after reporting a Failure
        naming the part setup failed in."""

        def keep(ws: StageWeightSync) -> None:  # closed at teardown, even after a failure
            self.weight_sync = ws

        try:
            await set_up(
                self.spec,
                self.topo,
                secret=self._secret,
                config_hash=self.config_hash,
                worker=self.worker,
                roles=self.roles,
                keep_weight_sync=keep,
            )
        except SetupFailed as failed:
            exc = failed.__cause__ or failed
            log.error("setup of %s failed: %r", failed.part, exc)
            await self._send_failure(self._failure(-1, -1, -1, failed.part, "setup", exc))
            return None
        return TaskRunner(
            stage=self.stage,
            replica=self.replica,
            roles=self.roles,
            weight_sync=self.weight_sync,
            worker=self.worker,
            send=self._send,
            send_failure=self._send_failure,
        )

    # ------------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            try:
                rx = await self.chan.recv()
            except HybridflowError as exc:
                log.error("receive failed, stopping: %s", exc)
                self._stop.set()
                return
            if isinstance(rx.msg, (Task, Control)):
                self._enqueue(rx)
            elif isinstance(rx.msg, Shutdown):
                log.info("shutdown: %s", rx.msg.reason or "requested")
                self._stop.set()
                return

    def _enqueue(self, rx: Received) -> None:
        """Queue a Task or Control call for the work loop. More than the queue holds is
        the coordinator breaking its own bound: an error of this loop (a Failure naming
        it), never a queue that grows without end."""
        try:
            self._queue.put_nowait(rx)
        except asyncio.QueueFull:
            raise PipelineError(
                f"stage {self.stage}/{self.replica} was sent more than "
                f"run.max_inflight={self.topo.run.max_inflight} tasks (+1 control call) "
                "not yet started; the coordinator keeps at most that many out"
            ) from None
        if isinstance(rx.msg, Task):
            self.worker.hold(rx.msg.task_id)

    def _on_bad_message(self, peer: bytes | None, exc: HybridflowError, msg: Msg | None) -> None:
        """A message from the coordinator could not be decoded (e.g. a shared-memory
        segment of its tensors was removed): if it was a Task or a Control call, answer it
        with a Failure naming it, so the run ends with this error instead of waiting for
        an answer that will never come. A message without a readable header cannot be
        named; the coordinator's lost-task bound catches what it was."""
        if isinstance(msg, Task):
            task_id, step, mb, role, op = msg.task_id, msg.step, msg.mb_id, msg.role, msg.op
        elif isinstance(msg, Control):
            task_id, step, mb, role = msg.control_id, msg.step, -1, CONTROL
            op = str(type(msg.call).__struct_config__.tag)
        else:
            return
        err = type(exc)(f"the {type(msg).__name__} message could not be decoded: {exc}")
        bad = self._failure(task_id, step, mb, role, op, err)
        self._report(self._send_failure(bad), f"stage.undecodable.{task_id}")

    async def _send_failure(self, failure: Failure) -> None:
        """Report a failure; if even that cannot be sent, the coordinator is gone: stop."""
        try:
            await self._send(failure)
        except HybridflowError as send_exc:
            log.error("cannot send to the coordinator, stopping: %s", send_exc)
            self._stop.set()

    # ------------------------------------------------------------------------------
    def _state_name(self) -> StageState:
        running = self.tasks.running if self.tasks is not None else 0
        if self.state is StageState.READY and (self.worker.busy or running):
            return StageState.BUSY
        return self.state

    async def _watch_parent(self) -> None:
        # PR_SET_PDEATHSIG already kills us with the parent on Linux; this covers the rest.
        while self.parent_alive():
            await asyncio.sleep(self.topo.liveness.heartbeat_interval_s)
        log.error("parent process %d is gone; exiting", self.spec.parent_pid)
        self._stop.set()

    def parent_alive(self) -> bool:
        return os.getppid() == self.spec.parent_pid

    async def _send(self, msg: Msg, tensors: dict[str, Any] | None = None) -> None:
        timeout = self.topo.liveness.heartbeat_timeout_s
        await self.chan.send(
            msg, tensors, timeout=timeout, timeout_setting="liveness.heartbeat_timeout_s"
        )

    def _failure(
        self, task_id: int, step: int, mb_id: int, role: str, op: str, exc: BaseException
    ) -> Failure:
        return failure(self.stage, self.replica, task_id, step, mb_id, role, op, exc)

    async def _close_roles(self) -> None:
        timeout = self.topo.liveness.shutdown_timeout_s
        for name, role in self.roles.items():
            try:
                aclose = getattr(role, "aclose", None)
                if aclose is not None:  # what lives on this loop goes first, on this loop
                    await asyncio.wait_for(aclose(), timeout)
                await asyncio.wait_for(self.worker.call(role.close), timeout)
            except TimeoutError:
                self.worker_stuck = True
                log.warning("role %s did not close within liveness.shutdown_timeout_s", name)
                break
            except BaseException as exc:  # teardown goes on: the next role, the sockets
                if interrupted(exc):
                    raise
                log.error("role %s failed to close", name, exc_info=exc)
        if not self.worker_stuck:
            self.worker.shutdown()

"""One stage replica: an OS process hosting one or more roles, driven by the coordinator.

Life cycle (`StageState`):
  CONNECTING  DEALER connects to the coordinator's ROUTER as `<stage>/<replica>#<random>`;
              Hello(stage, replica, pid, roles, config hash, schema version, proof: HMAC
              of the run secret, transport/auth.py) -> Welcome within startup_timeout_s
  SETUP       roles built (`create_role`) and `Role.setup(StageContext)` run in the worker
              thread while heartbeats go on (model loading may take minutes)
  READY       tasks are dispatched in arrival order by the op declarations of the roles
              (stages/contract.py); the heartbeat reports BUSY while any task runs
  STOPPING    Shutdown received (or the parent died): roles closed, sockets closed, exit

Concurrency: the asyncio loop owns the socket (receive, heartbeat, send). Role code of
plain ops runs in ONE worker thread (one at a time, in order: roles need no locks), so
heartbeats keep flowing while a role computes; ops declared `concurrent` are coroutines
awaited on the loop, several at once (a rollout engine batching micro-batches, a reward
service awaiting HTTP). A step op, a weight-sync op or a `Control` call is a barrier
for the process. A task, control call or setup that raises anything (any BaseException:
torch's CheckpointException, a GeneratorExit, a library's sys.exit), except this process's
own teardown (`_interrupted`), becomes a `Failure` message naming the stage, the op or
call and the cause, with the traceback text; the process keeps serving until the
coordinator says Shutdown. A loop of the process (receive, work, heartbeat, parent watch)
that dies is a Failure naming the stage and the loop, then a stop (exit 1), at once.

What a role gets in `StageContext.world` (a typed `StageWorld`, stages/base.py): its role
name and kind, `rank` (= replica) and `world_size` (= replicas of this stage), the
rendezvous of the stage's replicas (`init_method`, "" when there is one; replica 0 also
inherits its listening socket, `init_listen_fd`), `run_id`, and `dataflow`: op -> `OpIO`
(inputs, outputs, scope) for every op of this role. `ctx.seed` is the run seed, the same in every
stage (actor and reference build identical initial weights from it); derive per-purpose
streams from it. `ctx.colocated` holds every role of this process (the hybrid engine's
in-process hand-off); they are all constructed before any `setup`, in config order, and
a role's `bind_colocated()` (when it has one) runs once every setup has returned.

Seeds: before any role exists, the process's global RNGs (torch, Python, NumPy) are
seeded from (run seed, stage, replica), so code that draws from them is reproducible.
Checkpoints (pipeline/checkpoint/store.py): the control call `CheckpointSave` (a `Control`
message, never a role's Task) is answered by the process itself (every role's state_dict + RNG written to the given directory); a
payload with `resume_dir` restores roles and RNG right after setup. Log lines carry
stage/replica and the step of the task being run.
Disaggregated reshard (pipeline/host/weight_sync.py): when the topology links an actor's
`reshard` to a `load_weights` in another stage, the process answers those two ops itself:
weights stream stage to stage over the endpoint in the payload's `weight_sync`.

Each task's `params` are the op's configured params plus `step`, `mb_id` and
`policy_version` from the Task. Results carry `info["compute_s"]`, the seconds the op ran
(a plain op: in the worker thread, its wait for the thread excluded; a concurrent op: the
call's wall time), which the coordinator reports per phase.

Exit codes: 0 after Shutdown, 3 handshake rejected, 4 coordinator unreachable/gone,
1 an unexpected exception or a dead loop of the process (logged).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hybridflow.config.loader import config_hash, from_dict
from hybridflow.config.schema import RoleConfig, Topology
from hybridflow.errors import ConfigError, HybridflowError
from hybridflow.pipeline.checkpoint import stage as checkpoint
from hybridflow.pipeline.host.dispatch import Dispatcher, Mode
from hybridflow.pipeline.host.weight_sync import StageWeightSync
from hybridflow.pipeline.plan.planner import role_ops
from hybridflow.stages import StageContext, create_role
from hybridflow.stages.base import Role, StageWorld
from hybridflow.stages.contract import OpSpec, Scope
from hybridflow.transport import aio, auth
from hybridflow.transport.channel import Channel, Received
from hybridflow.transport.liveness import Heartbeater, Progress
from hybridflow.transport.protocol import (
    CheckpointSave,
    Control,
    ControlDone,
    Failure,
    Hello,
    Msg,
    Result,
    Shutdown,
    StageState,
    Task,
    Welcome,
)

log = logging.getLogger("hybridflow.stage")


_current_step = "-"  # step of the task in the worker thread (shown in log lines)
CONTROL = "control"  # the `role` of a Failure of a Control call: "control.checkpoint_save"
LOOP = "loop"  # the `role` of a Failure of a dead loop of the process: "loop.work"


def _add_step(record: logging.LogRecord) -> bool:
    record.step = _current_step
    return True


def main(payload: dict[str, Any]) -> int:
    """Entry point in the child (called by the launcher's bootstrap with plain data)."""
    topo = from_dict(Topology, payload["topology"])
    stage, replica = str(payload["stage"]), int(payload["replica"])
    logging.basicConfig(
        level=topo.log_level,
        format=f"%(asctime)s %(levelname)s [{stage}/{replica} step %(step)s] %(name)s: %(message)s",
        force=True,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(_add_step)
    checkpoint.seed_process(checkpoint.derive_seed(topo.seed, stage, replica))
    proc = StageProcess(topo, stage, replica, payload)
    code = aio.run(proc.run())
    if proc.worker_stuck:
        # The launcher's bootstrap leaves with os._exit, so a stuck worker thread does not
        # keep the process alive; say that it was abandoned.
        log.warning("worker thread still busy at exit; abandoning it")
    return code


class StageProcess:
    def __init__(self, topo: Topology, stage: str, replica: int, payload: dict[str, Any]) -> None:
        self.topo = topo
        self.stage, self.replica = stage, replica
        self.cfg = topo.stages[stage]
        self.endpoint = str(payload["endpoint"])
        self.run_id = str(payload["run_id"])
        self.run_dir = Path(str(payload["run_dir"]))
        self.init_method = str(payload.get("init_method", ""))
        self.init_listen_fd = int(payload.get("init_listen_fd", -1))  # replica 0 only
        self.parent_pid = int(payload.get("parent_pid", os.getppid()))
        self.resume_dir = str(payload.get("resume_dir") or "")
        # The run's secret (stdin JSON only: never argv, env or a file) proves this process
        # to the coordinator and to weight-link peers (transport/auth.py); kept off `payload`.
        self._secret = bytes.fromhex(str(payload.pop("secret", "")))
        self.identity = auth.connection_identity(f"{stage}/{replica}")
        # Disaggregated reshard (weight_sync.py): endpoints the runner allocated, if any.
        self.weight_sync_spec = dict(payload.get("weight_sync") or {})
        self.weight_sync: StageWeightSync | None = None
        self.kinds = {name: rc.kind or name for name, rc in self.cfg.roles.items()}
        self.config_hash = config_hash(topo)
        self.state = StageState.CONNECTING
        self.roles: dict[str, Role] = {}
        self.worker_stuck = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"{stage}-{replica}-worker")
        self._queue: asyncio.Queue[Received] = asyncio.Queue()
        self._stop = asyncio.Event()
        self._busy = False  # the worker thread is running something
        self._running = 0  # tasks started and not yet answered
        # Task id -> started? for every Task received and not yet answered, in arrival
        # order (heartbeats report it: the coordinator's deadlines and lost-task check).
        # The worker thread flips its task to True when it actually starts it.
        self._held: dict[int, bool] = {}
        self._worker_since = 0.0  # monotonic start of the worker's current call; 0: idle
        self._reports: set[asyncio.Task[None]] = set()  # Failures for undecodable tasks
        self._ran_s: dict[int, float] = {}  # task id -> seconds its op ran in the worker
        self._crashed = False  # a loop of the process died: exit 1 (the coordinator names it)

    # ------------------------------------------------------------------------------
    async def run(self) -> int:
        t = self.topo.transport
        self.chan = Channel(
            "dealer",
            self.endpoint,
            bind=False,
            name=f"stage {self.stage}/{self.replica}",
            run_id=self.run_id,
            identity=self.identity,
            hwm=t.hwm,
            shm_threshold=t.shm_threshold,
        )
        self.chan.on_bad_message = self._on_bad_message
        tasks: list[asyncio.Task[Any]] = []
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
                progress=self._progress,
            )
            tasks.append(self._supervise(self.heartbeat.start(), "heartbeat"))
            tasks.append(self._supervise(self._watch_parent(), "parent watch"))
            tasks.append(self._supervise(self._recv_loop(), "receive"))
            # Setup may take minutes (model loading): a Shutdown meanwhile must not wait.
            setup = asyncio.create_task(self._setup_roles(), name="stage.setup")
            stop = asyncio.create_task(self._stop.wait(), name="stage.stop")
            tasks += [setup, stop]
            await asyncio.wait([setup, stop], return_when=asyncio.FIRST_COMPLETED)
            if setup.done() and setup.result():
                self.state = StageState.READY
                self.heartbeat.beat()  # tell the coordinator at once, not one interval later
                tasks.append(self._supervise(self._work_loop(), "work"))
            elif setup.done():
                self.state = StageState.FAILED
            await self._stop.wait()
            if self._crashed:
                return 1
            return 0 if self.parent_alive() else 4
        finally:
            self.state = StageState.STOPPING
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
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
        failure = self._failure(-1, -1, -1, LOOP, name, exc)

        async def report_and_stop() -> None:
            try:  # bounded: _send's timeout; if even this fails, exit 1 says enough
                await self._send_failure(failure)
            finally:
                self._stop.set()

        report = asyncio.get_running_loop().create_task(report_and_stop(), name="stage.dead")
        self._reports.add(report)
        report.add_done_callback(self._reports.discard)

    async def _handshake(self) -> int:
        hello = Hello(
            stage=self.stage,
            replica=self.replica,
            pid=os.getpid(),
            roles=list(self.cfg.roles),
            config_hash=self.config_hash,
            proof=auth.proof(self._secret, self.run_id, self.stage, self.replica, self.identity),
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

    async def _setup_roles(self) -> bool:
        """Connect the weight-sync peers, build and set up every role, restore the
        checkpoint; -> ready? Whatever fails, Exception or not, is a Failure naming the
        part it failed in (`part`: "weight_sync", a role, "checkpoint")."""
        part = "device"
        try:
            device = torch.device(self.cfg.device_of(self.replica))
            if device.type == "cuda":
                # The current CUDA device is per thread and starts as cuda:0: make it this
                # stage's in the loop thread and in the worker thread, so code that captures
                # or allocates on the "current" device (CUDA graphs, NCCL) lands on the
                # stage's GPU. (Seen on two GPUs: a native rollout on cuda:1 failed its graph
                # capture at setup.)
                torch.cuda.set_device(device)
                await self._in_worker(torch.cuda.set_device, device)
            part = "weight_sync"  # connect weight-sync peers first: they meet while models load
            self.weight_sync = StageWeightSync.for_stage(
                self.topo,
                self.stage,
                self.replica,
                self.weight_sync_spec,
                run_id=self.run_id,
                config_hash=self.config_hash,
                secret=self._secret,
            )
            if self.weight_sync is not None:
                await self.weight_sync.start()
            for name, rc in self.cfg.roles.items():
                part = name  # import errors of a backend land here
                self.roles[name] = create_role(rc.kind or name, rc.backend)
            for name, rc in self.cfg.roles.items():
                part = name
                await self._in_worker(self.roles[name].setup, self._context(name, rc, device))
            for name, role in self.roles.items():
                # What a role takes from a neighbour set up after it (a reference lent
                # the LoRA actor's base weights: stages/reference.py), once all are up.
                bind = getattr(role, "bind_colocated", None)
                if callable(bind):
                    part = name
                    await self._in_worker(bind)
            if self.resume_dir:
                part = "checkpoint"
                await self._in_worker(
                    checkpoint.load_stage,
                    self.roles,
                    self.kinds,
                    Path(self.resume_dir),
                    self.stage,
                    self.replica,
                )
        except BaseException as exc:  # not only Exception: see _interrupted
            if _interrupted(exc):
                raise
            await self._fail_setup(part, exc)
            return False
        log.info("ready: roles %s on %s", ", ".join(self.roles), device)
        return True

    def _context(self, name: str, rc: RoleConfig, device: torch.device) -> StageContext:
        return StageContext(
            stage=self.stage,
            replica=self.replica,
            device=device,
            seed=self.topo.seed,
            run_dir=self.run_dir,
            options=dict(rc.options),
            colocated=self.roles,
            world=StageWorld(
                role=name,
                kind=rc.kind or name,
                rank=self.replica,
                world_size=self.cfg.replicas,
                init_method=self.init_method,  # "" unless replicas > 1
                init_listen_fd=self.init_listen_fd,  # its listening socket (rank 0)
                run_id=self.run_id,
                dataflow=role_ops(self.topo, name),
            ),
            log=logging.getLogger(f"hybridflow.stage.{name}"),
        )

    async def _fail_setup(self, part: str, exc: BaseException) -> None:
        log.error("setup of %s failed: %r", part, exc)
        await self._send_failure(self._failure(-1, -1, -1, part, "setup", exc))

    # ------------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        try:
            while True:
                rx = await self.chan.recv()
                if isinstance(rx.msg, Task):
                    self._held[rx.msg.task_id] = False
                if isinstance(rx.msg, (Task, Control)):
                    self._queue.put_nowait(rx)
                elif isinstance(rx.msg, Shutdown):
                    log.info("shutdown: %s", rx.msg.reason or "requested")
                    self._stop.set()
                    return
        except HybridflowError as exc:
            log.error("receive failed, stopping: %s", exc)
            self._stop.set()

    async def _work_loop(self) -> None:
        """Start tasks in arrival order under the contract's rules (dispatch.py): concurrent
        ops side by side, plain ops queued for the one worker thread, step ops and Control
        calls as barriers of the process."""
        dispatch = Dispatcher()
        staging: set[asyncio.Future[Any]] = set()  # staged weight receives not yet applied
        try:
            while True:
                rx = await self._queue.get()
                msg = rx.msg
                if isinstance(msg, Control):
                    await dispatch.submit(lambda m=msg: self._run_control(m), mode=Mode.BARRIER)
                    continue
                task: Task = msg  # type: ignore[assignment]
                if self.weight_sync is not None and self.weight_sync.stages(task):
                    # Staged weight load: receive now beside the running tasks, load at
                    # the barrier (weight_sync.py, `stage_weights`).
                    staged = asyncio.ensure_future(self.weight_sync.stage(task))
                    staging.add(staged)
                    staged.add_done_callback(staging.discard)
                    await dispatch.submit(
                        lambda t=task, st=staged: self._run_task(t, {}, None, staged=st),
                        mode=Mode.BARRIER,
                    )
                    continue
                spec, barrier = self._classify(task)
                if barrier:
                    mode = Mode.BARRIER
                elif spec is not None and spec.concurrent:
                    mode = Mode.CONCURRENT
                else:
                    mode = Mode.PLAIN
                await dispatch.submit(
                    lambda t=task, b=rx.tensors, s=spec: self._run_task(t, b, s),
                    mode=mode,
                    role=task.role,
                    name=f"stage.task.{task.role}.{task.op}.{task.step}.{task.mb_id}",
                )
        finally:
            for fut in staging:  # teardown before their barrier ran
                fut.cancel()
            await dispatch.close()

    def _classify(self, task: Task) -> tuple[OpSpec | None, bool]:
        """-> (the op's declaration, None for weight-sync ops; whether it is a barrier)."""
        if self.weight_sync is not None and self.weight_sync.handles(task):
            return None, True
        role = self.roles.get(task.role)
        if role is None:
            return None, False  # _run_task reports the unknown role
        spec = type(role).find_op(task.op)
        if spec is None:
            return None, False  # _run_task reports the unknown op
        return spec, spec.scope is Scope.STEP

    async def _run_task(
        self,
        task: Task,
        batch: dict[str, torch.Tensor],
        spec: OpSpec | None,
        staged: asyncio.Future[Any] | None = None,
    ) -> None:
        role = self.roles.get(task.role)
        params = dict(task.params)
        params.update(step=task.step, mb_id=task.mb_id, policy_version=task.policy_version)
        t0 = time.perf_counter()
        global _current_step
        _current_step = str(task.step)
        self._running += 1
        try:
            if role is None:
                raise KeyError(f"role {task.role!r} is not hosted here (have {list(self.roles)})")
            elif self.weight_sync is not None and staged is not None:
                self._held[task.task_id] = True
                outputs, metrics = (
                    {},
                    await self.weight_sync.apply(task, staged, self.roles, params, self._in_worker),
                )
            elif self.weight_sync is not None and self.weight_sync.handles(task):
                # Disaggregated reshard: weights stream stage to stage, not via the role.
                self._held[task.task_id] = True
                outputs, metrics = (
                    {},
                    await self.weight_sync.run(task, self.roles, params, self._in_worker),
                )
            else:
                spec = spec or type(role).op_spec(task.op)  # raises UnknownOpError
                method = role.bound_op(spec)
                if spec.concurrent:
                    self._held[task.task_id] = True
                    outputs, metrics = await method(batch, params)
                else:
                    outputs, metrics = await self._in_worker(
                        method, batch, params, task_id=task.task_id
                    )
            result = Result(
                run_id=task.run_id,
                task_id=task.task_id,
                step=task.step,
                mb_id=task.mb_id,
                policy_version=task.policy_version,
                role=task.role,
                op=task.op,
                metrics={str(k): float(v) for k, v in metrics.items()},
                # Plain ops: seconds the worker thread spent in the op (queueing behind
                # other tasks excluded); concurrent ops: the call's wall time.
                info={"compute_s": self._ran_s.pop(task.task_id, time.perf_counter() - t0)},
            )
            await self._send(result, outputs)
        except BaseException as exc:  # not only Exception: see _interrupted
            if _interrupted(exc):
                raise
            await self._report(task, exc)
        finally:
            self._running -= 1
            self._held.pop(task.task_id, None)
            self._ran_s.pop(task.task_id, None)

    async def _run_control(self, msg: Control) -> None:
        """A control call of the coordinator (typed arguments, protocol.py): answered with
        ControlDone, or Failure naming the call."""
        global _current_step
        _current_step = str(msg.step)
        call = msg.call
        self._running += 1
        try:
            if isinstance(call, CheckpointSave):
                metrics = await self._in_worker(
                    checkpoint.save_stage,
                    self.roles,
                    self.kinds,
                    Path(call.dir),
                    self.stage,
                    self.replica,
                    call.export,
                )
            else:  # pragma: no cover - decoding admits only the calls above
                raise TypeError(f"unknown control call {type(call).__name__}")
            done = ControlDone(
                run_id=msg.run_id,
                control_id=msg.control_id,
                metrics={str(k): float(v) for k, v in metrics.items()},
            )
            await self._send(done)
        except BaseException as exc:  # not only Exception: see _interrupted
            if _interrupted(exc):
                raise
            name = type(call).__struct_config__.tag
            log.error("control call %s failed: %r", name, exc)
            await self._send_failure(
                self._failure(msg.control_id, msg.step, -1, CONTROL, str(name), exc)
            )
        finally:
            self._running -= 1

    async def _report(self, task: Task, exc: BaseException) -> None:
        log.error("%s.%s step %d mb %d failed: %r", task.role, task.op, task.step, task.mb_id, exc)
        await self._send_failure(
            self._failure(task.task_id, task.step, task.mb_id, task.role, task.op, exc)
        )

    async def _in_worker(self, fn: Any, *args: Any, task_id: int | None = None) -> Any:
        """Run `fn(*args)` in the worker thread; `task_id`: the Task it serves, marked
        started when the thread actually starts it (not while it waits for the thread)."""

        def call() -> Any:
            self._worker_since = start = time.monotonic()
            if task_id is not None and task_id in self._held:
                self._held[task_id] = True  # an existing key: safe from this thread
            try:
                return fn(*args)
            finally:
                self._worker_since = 0.0
                if task_id is not None:  # the op's own time, not its wait for the thread
                    self._ran_s[task_id] = time.monotonic() - start

        self._busy = True
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, call)
        finally:
            self._busy = False

    def _progress(self) -> Progress:
        """What the heartbeat reports: tasks running, tasks queued, worker busy seconds."""
        held = list(self._held.items())
        since = self._worker_since
        busy_s = time.monotonic() - since if since else 0.0
        return [t for t, on in held if on], [t for t, on in held if not on], busy_s

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
        failure = self._failure(task_id, step, mb, role, op, err)
        report = asyncio.get_running_loop().create_task(
            self._send_failure(failure), name=f"stage.undecodable.{task_id}"
        )
        self._reports.add(report)
        report.add_done_callback(self._reports.discard)

    async def _send_failure(self, failure: Failure) -> None:
        """Report a failure; if even that cannot be sent, the coordinator is gone: stop."""
        try:
            await self._send(failure)
        except HybridflowError as send_exc:
            log.error("cannot send to the coordinator, stopping: %s", send_exc)
            self._stop.set()

    # ------------------------------------------------------------------------------
    def _state_name(self) -> StageState:
        if self.state is StageState.READY and (self._busy or self._running):
            return StageState.BUSY
        return self.state

    async def _watch_parent(self) -> None:
        # PR_SET_PDEATHSIG already kills us with the parent on Linux; this covers the rest.
        while self.parent_alive():
            await asyncio.sleep(self.topo.liveness.heartbeat_interval_s)
        log.error("parent process %d is gone; exiting", self.parent_pid)
        self._stop.set()

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    async def _send(self, msg: Msg, tensors: dict[str, torch.Tensor] | None = None) -> None:
        timeout = self.topo.liveness.heartbeat_timeout_s
        await self.chan.send(
            msg, tensors, timeout=timeout, timeout_setting="liveness.heartbeat_timeout_s"
        )

    def _failure(
        self, task_id: int, step: int, mb_id: int, role: str, op: str, exc: BaseException
    ) -> Failure:
        return Failure(
            stage=self.stage,
            replica=self.replica,
            task_id=task_id,
            step=step,
            mb_id=mb_id,
            role=role,
            op=op,
            error_type=type(exc).__name__,
            message=(str(exc) or "(no message)")[:4000],
            # A ConfigError names the key (a file's, an option's) and the fix: its stack
            # adds nothing but lines between the user and that one line.
            traceback="" if isinstance(exc, ConfigError) else _role_traceback(exc)[-16000:],
        )

    async def _close_roles(self) -> None:
        timeout = self.topo.liveness.shutdown_timeout_s
        for name, role in self.roles.items():
            try:
                aclose = getattr(role, "aclose", None)
                if aclose is not None:  # what lives on this loop goes first, on this loop
                    await asyncio.wait_for(aclose(), timeout)
                await asyncio.wait_for(self._in_worker(role.close), timeout)
            except TimeoutError:
                self.worker_stuck = True
                log.warning("role %s did not close within liveness.shutdown_timeout_s", name)
                break
            except BaseException as exc:  # teardown goes on: the next role, the sockets
                if _interrupted(exc):
                    raise
                log.error("role %s failed to close", name, exc_info=exc)
        if not self.worker_stuck:
            self._pool.shutdown(wait=False)


def _interrupted(exc: BaseException) -> bool:
    """Whether `exc`, met by a handler of this process, is the process being stopped
    (it stays an interrupt: re-raised) rather than something failing (it becomes a
    Failure naming the stage, the op or control call and the cause).

    Catching only `Exception` is not enough: torch's CheckpointException (a full disk
    under a weight-shard write), a GeneratorExit leaking from a library's generator or a
    library's sys.exit are BaseExceptions, and one that escapes a handler kills its task
    unseen while the coordinator waits for an answer that never comes.

    A stage process is stopped by Shutdown, and its teardown cancels its tasks: that
    cancellation (the current task is `cancelling()`) is the interrupt. It ignores SIGINT
    and installs no handler that raises (launcher.py), so a KeyboardInterrupt here is a
    real Ctrl-C only where SIGINT keeps Python's default handler (a stage started by hand);
    a SystemExit, a GeneratorExit or a CancelledError nobody asked for was raised by code."""
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        return task is not None and task.cancelling() > 0
    if isinstance(exc, KeyboardInterrupt):
        return signal.getsignal(signal.SIGINT) is signal.default_int_handler
    return False


def _role_traceback(exc: BaseException) -> str:
    """The traceback from the role's code down: frames of the runtime's own plumbing
    (this module, asyncio, the executor) say nothing to the user and are dropped."""
    tb = exc.__traceback__
    skip = (__file__, os.sep + "asyncio" + os.sep, os.sep + "concurrent" + os.sep)
    while (
        tb is not None
        and tb.tb_next is not None
        and any(s in tb.tb_frame.f_code.co_filename for s in skip)
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))

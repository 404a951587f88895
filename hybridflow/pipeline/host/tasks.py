"""What a ready stage process does: start the coordinator's Tasks and Control calls in
arrival order under the op declarations' rules (dispatch.py), run each, and answer it.

  - a plain op runs in the one worker thread (worker.py), queued behind the others;
  - an op declared `concurrent` is a coroutine awaited on the loop, several at once (a
    rollout engine batching micro-batches, a reward service awaiting HTTP);
  - a step op, an end of a weight link (weight_sync.py: `Via`, from the plan's links, never
    from op names) and a Control call are barriers of the process.

Each task's `params` are the op's configured params plus `step`, `mb_id` and
`policy_version` from the Task. A Result carries the outputs the Task names only
(`Task.returns`: the job's declared outputs, plus the sample fields it records). Results carry `info["compute_s"]`, the seconds the op ran
(a plain op: in the worker thread, its wait for the thread excluded; a concurrent op: the
call's wall time), which the coordinator reports per phase. Whatever a task or a control
call raises (any BaseException but this process's own teardown: failures.interrupted) is
answered with a Failure naming the stage, the op or call and the cause.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from hybridflow.pipeline.checkpoint import stage as checkpoint
from hybridflow.pipeline.host.dispatch import Dispatcher, Mode
from hybridflow.pipeline.host.failures import CONTROL, failure, interrupted
from hybridflow.pipeline.host.weight_sync import StageWeightSync, Via
from hybridflow.pipeline.host.worker import Worker, current_task
from hybridflow.stages.base import Role
from hybridflow.stages.contract import OpSpec, Scope
from hybridflow.transport.channel import Received
from hybridflow.transport.protocol import (
    CheckpointSave,
    Control,
    ControlDone,
    Failure,
    Msg,
    Result,
    Task,
)

log = logging.getLogger("hybridflow.stage")

Send = Callable[[Msg, "dict[str, torch.Tensor] | None"], Awaitable[None]]

_current_step = "-"  # step of the task being run (shown in log lines: add_step)


def add_step(record: logging.LogRecord) -> bool:
    """Logging filter: every line of the process carries the step of its current task."""
    record.step = _current_step
    return True


def _set_step(step: int) -> None:
    global _current_step
    _current_step = str(step)


class TaskRunner:
    def __init__(
        self,
        *,
        stage: str,
        replica: int,
        roles: Mapping[str, Role],
        weight_sync: StageWeightSync | None,
        worker: Worker,
        send: Send,
        send_failure: Callable[[Failure], Awaitable[None]],
    ) -> None:
        self.stage, self.replica = stage, replica
        self.roles = roles
        self.weight_sync = weight_sync
        self.worker = worker
        self._send, self._send_failure = send, send_failure
        self.running = 0  # tasks and control calls started and not yet answered

    async def work_loop(self, queue: asyncio.Queue[Received]) -> None:
        """Start what `queue` holds in arrival order (see the module docstring)."""
        dispatch = Dispatcher()
        staging: set[asyncio.Future[Any]] = set()  # staged weight receives not yet applied
        try:
            while True:
                rx = await queue.get()
                msg = rx.msg
                if isinstance(msg, Control):
                    await dispatch.submit(lambda m=msg: self._run_control(m), mode=Mode.BARRIER)
                    continue
                task: Task = msg  # type: ignore[assignment]
                via = self._via(task)
                if via is Via.STAGE:
                    # Staged weight load: receive now beside the running tasks, load at
                    # the barrier (weight_sync.py, `stage_weights`).
                    assert self.weight_sync is not None
                    staged = asyncio.ensure_future(self.weight_sync.stage(task))
                    staging.add(staged)
                    staged.add_done_callback(staging.discard)
                    await dispatch.submit(
                        lambda t=task, st=staged: self._run_task(t, {}, None, Via.STAGE, st),
                        mode=Mode.BARRIER,
                    )
                    continue
                spec = None if via is not None else self._op_spec(task)
                if via is not None or (spec is not None and spec.scope is Scope.STEP):
                    mode = Mode.BARRIER  # step ops and link ends: barriers of the process
                elif spec is not None and spec.concurrent:
                    mode = Mode.CONCURRENT
                else:
                    mode = Mode.PLAIN
                await dispatch.submit(
                    lambda t=task, b=rx.tensors, s=spec, v=via: self._run_task(t, b, s, v),
                    mode=mode,
                    role=task.role,
                    name=f"stage.task.{task.role}.{task.op}.{task.step}.{task.mb_id}",
                )
        finally:
            for fut in staging:  # teardown before their barrier ran
                fut.cancel()
            await dispatch.close()

    def _via(self, task: Task) -> Via | None:
        """How the host runs `task` when it is an end of a weight link (None: the role)."""
        if self.weight_sync is None:
            return None
        return self.weight_sync.routes.get((task.role, task.op))

    def _op_spec(self, task: Task) -> OpSpec | None:
        """The op's declaration (None: unknown role or op, which _run_task reports)."""
        role = self.roles.get(task.role)
        return None if role is None else type(role).find_op(task.op)

    async def _run_task(
        self,
        task: Task,
        batch: dict[str, torch.Tensor],
        spec: OpSpec | None,
        via: Via | None = None,
        staged: asyncio.Future[Any] | None = None,
    ) -> None:
        role = self.roles.get(task.role)
        params = dict(task.params)
        params.update(step=task.step, mb_id=task.mb_id, policy_version=task.policy_version)
        t0 = time.perf_counter()
        _set_step(task.step)
        self.running += 1
        try:
            if role is None:
                raise KeyError(f"role {task.role!r} is not hosted here (have {list(self.roles)})")
            elif via is not None:
                outputs, metrics = {}, await self._sync_weights(task, via, params, staged)
            else:
                spec = spec or type(role).op_spec(task.op)  # raises UnknownOpError
                method = role.bound_op(spec)
                if spec.concurrent:
                    self.worker.started(task.task_id)
                    token = current_task.set(task.task_id)
                    try:
                        outputs, metrics = await method(batch, params)
                    finally:
                        current_task.reset(token)
                else:
                    outputs, metrics = await self.worker.call(
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
                info={"compute_s": self.worker.ran_s(task.task_id, t0)},
            )
            await self._send(result, self._returned(task, outputs))
        except BaseException as exc:  # not only Exception: see failures.interrupted
            if interrupted(exc):
                raise
            log.error(
                "%s.%s step %d mb %d failed: %r", task.role, task.op, task.step, task.mb_id, exc
            )
            await self._send_failure(
                self.failure(task.task_id, task.step, task.mb_id, task.role, task.op, exc)
            )
        finally:
            self.running -= 1
            self.worker.release(task.task_id)

    @staticmethod
    def _returned(task: Task, outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What goes back: the outputs the Task names (the job's declared outputs, and
        the sample fields when it records samples; a missing declared one is the
        scheduler's StageError). Anything else an op returns stays here instead of
        crossing the socket to be dropped."""
        if task.returns is None:
            return outputs
        keep = set(task.returns)
        return {k: v for k, v in outputs.items() if k in keep}

    async def _sync_weights(
        self, task: Task, via: Via, params: dict[str, Any], staged: asyncio.Future[Any] | None
    ) -> dict[str, float]:
        """Disaggregated reshard: weights stream stage to stage, not via the role."""
        assert self.weight_sync is not None
        self.worker.started(task.task_id)
        if staged is not None:
            return await self.weight_sync.apply(task, staged, self.roles, params, self.worker.call)
        return await self.weight_sync.run(task, via, self.roles, params, self.worker.call)

    async def _run_control(self, msg: Control) -> None:
        """A control call of the coordinator (typed arguments, protocol.py): answered with
        ControlDone, or Failure naming the call."""
        _set_step(msg.step)
        call = msg.call
        self.running += 1
        try:
            if isinstance(call, CheckpointSave):
                metrics = await self.worker.call(
                    checkpoint.save_stage,
                    self.roles,
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
            await self._send(done, None)
        except BaseException as exc:  # not only Exception: see failures.interrupted
            if interrupted(exc):
                raise
            name = str(type(call).__struct_config__.tag)
            log.error("control call %s failed: %r", name, exc)
            await self._send_failure(self.failure(msg.control_id, msg.step, -1, CONTROL, name, exc))
        finally:
            self.running -= 1

    def failure(
        self, task_id: int, step: int, mb_id: int, role: str, op: str, exc: BaseException
    ) -> Failure:
        return failure(self.stage, self.replica, task_id, step, mb_id, role, op, exc)

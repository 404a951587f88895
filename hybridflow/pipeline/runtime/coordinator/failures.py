"""What goes wrong on the coordinator's side of a job, as the named error the job ends with.

Every failure the coordinator hears of or meets is translated here, once, into the error
hierarchy (hybridflow/errors.py), with the stage, replica, step and micro-batch it is
about:

    Failure from a stage (its traceback)     -> StageError (+ a hint for an OOM on a GPU
                                                that several stage processes share)
    a message of a busy stage not decodable  -> StageError: what it carried is lost
    a driver op raising in the compute thread -> StageError (stage "driver")
    the data source raising in the io thread -> PipelineError naming data.source

`stopping` tells those apart from the coordinator itself being stopped (Ctrl-C, SIGTERM),
which is re-raised, never named as a failure.
"""

from __future__ import annotations

import asyncio
import traceback
from typing import Any

from hybridflow.errors import PipelineError, StageError
from hybridflow.pipeline.host.failures import LOOP
from hybridflow.pipeline.plan.planner import Plan, ProcessInfo
from hybridflow.pipeline.runtime.peers import StagePeer
from hybridflow.pipeline.runtime.steps import Dispatch
from hybridflow.transport.protocol import Failure


def stopping(exc: BaseException) -> bool:
    """Whether `exc`, raised where a data source or a driver op runs, is the coordinator
    being stopped (re-raised) rather than the source or op failing (a named error). Ctrl-C
    and SIGTERM reach a job as the cancellation of its task (asyncio.Runner, session.py),
    so that cancellation is the one interrupt; a KeyboardInterrupt, SystemExit or other
    BaseException out of the worker thread was raised by the source's or op's code, and
    escaping here it would stop the event loop (or vanish with its task) unnamed."""
    task = asyncio.current_task()
    return isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling() > 0


def stage_failed(plan: Plan, peer: StagePeer, f: Failure) -> StageError:
    """A stage's Failure message (its op raised, its setup did, or a loop of the stage
    host died: host/stage_process.py)."""
    if f.op == "setup":
        where = "during setup"
    elif f.role == LOOP:
        where = f"- its {f.op} loop died"
    else:
        where = f"in {f.role}.{f.op} at step {f.step} micro-batch {f.mb_id}"
    return StageError(
        f"stage {f.stage} replica {f.replica} failed {where}: {f.error_type}: {f.message}"
        + oom_hint(plan, peer.info, f.error_type),
        stage=f.stage,
        replica=f.replica,
        step=f.step if f.step >= 0 else None,
        mb_id=f.mb_id if f.step >= 0 else None,
        remote_traceback=f.traceback,
    )


def undecodable(peer: StagePeer, exc: Exception, msg: Any) -> StageError:
    """A message of `peer`, which has tasks in flight, that could not be decoded."""
    what = type(msg).__name__ if msg is not None else "message (unreadable header)"
    return StageError(
        f"a {what} from {peer.name()} could not be decoded {peer.doing()}: {exc}; "
        "what it carried is lost, so the run cannot go on",
        **peer.where(),
    )


def driver_failed(d: Dispatch, exc: BaseException) -> StageError:
    """A driver op (run in the coordinator's compute thread) that raised."""
    return StageError(
        f"driver op {d.op.cfg.op} failed at step {d.step} micro-batch {d.mb_id}: "
        f"{type(exc).__name__}: {exc}",
        stage="driver",
        step=d.step,
        mb_id=d.mb_id,
        remote_traceback="".join(traceback.format_exception(exc)),
    )


def source_failed(source: str, step: int, exc: BaseException) -> PipelineError:
    """The data source (`data.source`, run in the io thread) raising for `step`."""
    return PipelineError(f"data source {source!r} failed for step {step}: {exc!r}")


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

"""How a stage process turns what went wrong into a `Failure` message: which exceptions are
failures and which are this process being stopped, and the traceback the user reads."""

from __future__ import annotations

import asyncio
import os
import signal
import traceback

from hybridflow.errors import ConfigError
from hybridflow.transport.protocol import Failure

CONTROL = "control"  # the `role` of a Failure of a Control call: "control.checkpoint_save"
LOOP = "loop"  # the `role` of a Failure of a dead loop of the process: "loop.work"
# Frames of the runtime's own plumbing, dropped from a role's traceback.
_PLUMBING = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,  # this package: the stage host
    os.sep + "asyncio" + os.sep,
    os.sep + "concurrent" + os.sep,
)


def failure(
    stage: str, replica: int, task_id: int, step: int, mb_id: int, role: str, op: str,
    exc: BaseException,
) -> Failure:  # fmt: skip
    return Failure(
        stage=stage,
        replica=replica,
        task_id=task_id,
        step=step,
        mb_id=mb_id,
        role=role,
        op=op,
        error_type=type(exc).__name__,
        message=(str(exc) or "(no message)")[:4000],
        # A ConfigError names the key (a file's, an option's) and the fix: its stack
        # adds nothing but lines between the user and that one line.
        traceback="" if isinstance(exc, ConfigError) else role_traceback(exc)[-16000:],
    )


def interrupted(exc: BaseException) -> bool:
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


def role_traceback(exc: BaseException) -> str:
    """The traceback from the role's code down: frames of the runtime's own plumbing
    (the stage host, asyncio, the executor) say nothing to the user and are dropped."""
    tb = exc.__traceback__
    while (
        tb is not None
        and tb.tb_next is not None
        and any(s in tb.tb_frame.f_code.co_filename for s in _PLUMBING)
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))

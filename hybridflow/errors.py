"""The exception hierarchy of hybridflow, in one place.

    HybridflowError
     ├── ConfigError            bad config key or value; message names the dotted key path
     │    └── CompileError      step logic (DataflowBuilder) rejected; names the line
     ├── AlgorithmInputError    tensors/options handed to hybridflow.algos are malformed
     ├── BatchError             a Batch/op/params handed to a role is malformed
     └── PipelineError          anything that stops a run
          ├── ProtocolError     a malformed / unknown / wrong-version message was received
          ├── TransportTimeout  a send/recv/handshake waited longer than its setting allows
          ├── PeerDeadError     a peer process died or stopped heartbeating
          │    └── StageDeadError   ... and that peer was a stage (names stage/replica/step/mb)
          ├── StageError        a stage raised; carries the remote traceback text
          ├── RewardServiceError an external reward service failed after its retries
          │    └── RewardProtocolError  ... or answered with a reply that breaks the protocol
          ├── RewardFunctionError a Python reward function raised or returned bad values
          └── EnvError          an environment's reset/step/close or tool failed (names it)
               ├── EnvTimeout        ... ran past its bound (names the setting)
               ├── EnvStuckError     ... too many timed-out calls are still running (max_stuck)
               └── EnvServiceError   an external environment service failed after its retries
                    └── EnvProtocolError  ... or answered with a reply that breaks the protocol

Lower-layer exceptions (zmq, msgspec, OSError) are translated into these in exactly one
place each (`raise X(...) from exc`), so callers only ever catch hybridflow errors.
"""

from __future__ import annotations


class HybridflowError(Exception):
    """Base class of every error hybridflow raises on purpose."""


class ConfigError(HybridflowError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or impossible.

    `path` is the dotted key (`stages.reward.replicas`); the message says how to fix it.
    """

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class CompileError(ConfigError):
    """Step logic given to `DataflowBuilder.define_training_step` cannot be compiled.

    `line` is the 1-based line of the logic text (0: the logic as a whole); the message
    quotes the line and says why it is rejected.
    """

    def __init__(self, line: int, message: str, source: str = "") -> None:
        self.line = line
        where = f"logic line {line}" if line else "logic"
        text = f"{message}\n    {line}: {source.strip()}" if source.strip() else message
        super().__init__(where, text)


class AlgorithmInputError(HybridflowError, ValueError):
    """Tensors or options given to a `hybridflow.algos` function are malformed.

    Wrong shapes, an empty mask where a statistic needs data, a group of one sample where
    a baseline needs others, an unknown estimator / aggregation / KL kind. The message
    names the function and the argument.
    """


class BatchError(HybridflowError, ValueError):
    """A role was handed a malformed task: unknown op, missing batch field, wrong shape,
    dtype or values (e.g. a prompt that is not left-padded). The message names the role,
    the op and the field."""


class PipelineError(HybridflowError):
    """A run cannot go on."""


class ProtocolError(PipelineError):
    """Received bytes are not a valid hybridflow message. Never fatal for the receiver."""


class TransportTimeout(PipelineError, TimeoutError):
    """A wait exceeded its bound; the message names the setting that bounds it."""


class PeerDeadError(PipelineError):
    """A peer process exited or missed its heartbeats."""


class StageDeadError(PeerDeadError):
    """A stage process died or went silent.

    Carries where it was: `stage`, `replica`, and the last `step` / `mb_id` it was given.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: str = "",
        replica: int = -1,
        step: int | None = None,
        mb_id: int | None = None,
    ) -> None:
        self.stage, self.replica, self.step, self.mb_id = stage, replica, step, mb_id
        super().__init__(message)


class StageError(PipelineError):
    """A stage raised while handling an event; `remote_traceback` is its traceback text."""

    def __init__(
        self,
        message: str,
        *,
        stage: str = "",
        replica: int = -1,
        step: int | None = None,
        mb_id: int | None = None,
        remote_traceback: str = "",
    ) -> None:
        self.stage, self.replica, self.step, self.mb_id = stage, replica, step, mb_id
        self.remote_traceback = remote_traceback
        text = message
        if remote_traceback:
            text += "\n--- remote traceback ---\n" + remote_traceback.rstrip()
        super().__init__(text)


class RewardServiceError(PipelineError):
    """An external reward service failed after retries (names service, status, sample ids)."""

    def __init__(
        self,
        message: str,
        *,
        service: str = "",
        status: str = "",
        sample_ids: tuple[str, ...] = (),
    ) -> None:
        self.service, self.status, self.sample_ids = service, status, sample_ids
        super().__init__(message)


class RewardProtocolError(RewardServiceError):
    """A reward service's reply broke the wire schema (missing/extra/duplicate ids, wrong
    count, NaN/inf, non-numbers, oversize, wrong version). Never retried, never a fallback
    score: a service that speaks the protocol wrongly is a bug to fix, not an outage."""


class RewardFunctionError(PipelineError):
    """A reward function (`package.module:function`) raised, or returned a wrong number of
    values or a NaN/inf/non-number. Names the function and the sample (row and id)."""

    def __init__(self, message: str, *, function: str = "", sample: int | None = None) -> None:
        self.function, self.sample = function, sample
        super().__init__(message)


class EnvError(PipelineError):
    """An environment's reset/step/close raised, ran past its bound or returned a
    malformed value. `what` names the call (e.g. "GuessNumberEnv.step"); the message
    names the cause. stages/env/protocol.py's `env_call` is where an environment's own
    exceptions become this."""

    def __init__(self, message: str, *, what: str = "") -> None:
        self.what = what
        super().__init__(message)


class EnvTimeout(EnvError, TimeoutError):
    """An environment call ran past its bound; the message names the call and the setting."""


class EnvStuckError(EnvError):
    """Too many calls of one environment method or tool timed out and are still running in
    their (unkillable) threads: it hangs on these inputs rather than being slow. Names the
    call, the count and `max_stuck`."""


class EnvServiceError(EnvError):
    """An external environment service failed after its retries, or refused a call. Names
    the service `url`, the `session_id`, the `call` (reset / step N / close) and the
    setting that bounded it; `status` is the last HTTP-style status or "unreachable"."""

    def __init__(
        self,
        message: str,
        *,
        url: str = "",
        session_id: str = "",
        call: str = "",
        status: str = "",
    ) -> None:
        self.url, self.session_id, self.call, self.status = url, session_id, call, status
        super().__init__(message, what=f"{url} {call}".strip())


class EnvProtocolError(EnvServiceError):
    """An environment service's reply broke the wire schema (undecodable, wrong version,
    another session's or step's reply, a non-finite reward, an observation on a done
    step). Never retried, never a fallback: a service that speaks the protocol wrongly
    is a bug to fix, not an outage."""

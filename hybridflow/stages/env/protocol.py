"""The environment protocol: what a multi-turn trajectory talks to, turn by turn.

One environment object per trajectory holds that trajectory's state (SkyRL-Gym's
`Env`, TRL's `environment_factory`: a fresh instance per rollout, no state shared):

    env = factory()                        # Class(**env_options), see registry.py
    first = await call(env.reset, record)  # Observation: the context of the first turn
    while True:
        ... the model generates one turn -> Action(text, token_ids)
        result = await call(env.step, action)   # StepResult(observation, reward, done, info)
        if result.done: break
        ... the observation's tokens are appended, the model continues

`reset(record)` receives the dataset row's metadata: the prompt record's other fields
(`data_source`, `reward_model.ground_truth`, `extra_info`, `index`, ...). It returns the
first observation: `Observation.empty()` keeps the dataset's prompt as it is (the common
case: tools and games whose prompt is a dataset field); messages replace it by that
conversation (templated with the environment's tools and a generation prompt); token ids
replace it by those ids.

`step(action)` receives one model turn: its decoded text and its token ids. It returns
the observation to append (chat messages, e.g. a `tool` message, or raw token ids; empty
when done), this turn's reward, whether the trajectory is over, and `info`: numeric
entries are counters the trajectory loop sums and reports as metrics (`tool_calls`,
`tool_errors`, ...); string entries are per-trajectory extras.

Either method may be `def` or `async def`; `call(method, *args, timeout_s=..., what=...)`
awaits both, a sync one in a daemon thread so that a slow environment never blocks the
event loop (stages/deadline.py; a method that keeps timing out is capped by
`max_stuck`). `close()` is optional (called once, when the trajectory ends).

Invariants: an Observation is exactly one of messages / token ids / nothing; every
message is a {role, content} mapping of strings; a StepResult's reward is a finite
float32 number; a done step carries no observation (what training sees must end on a
model turn). `call` returns the method's value, raises the method's own exception, or
raises EnvTimeout / EnvStuckError naming the call and its bound; `env_call` is the same
with the method's own exceptions as EnvError. Neither ever hangs past `timeout_s`.
The error classes live in hybridflow/errors.py (re-exported here).
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from hybridflow.errors import EnvError, EnvStuckError, EnvTimeout
from hybridflow.reward.values import BadReward, reward_number
from hybridflow.stages.deadline import DaemonCalls, TooManyStuck, as_asyncio

__all__ = [
    "DEFAULT_MAX_STUCK",
    "Action",
    "EnvError",
    "EnvStuckError",
    "EnvTimeout",
    "Environment",
    "Message",
    "Observation",
    "ObservationKind",
    "StepResult",
    "call",
    "close_env",
    "env_call",
    "is_environment",
    "stuck_calls",
]

Message = dict[str, Any]  # {"role": str, "content": str, [+ "name", "tool_call_id", ...]}
InfoValue = float | int | str


class ObservationKind(enum.Enum):
    EMPTY = "empty"
    MESSAGES = "messages"
    TOKENS = "tokens"


@dataclass(frozen=True)
class Observation:
    """What the environment shows the model: chat `messages` (templated by the trajectory
    loop as the delta after an assistant turn), raw `token_ids` (appended as they are), or
    neither. Build one with `empty()`, `from_messages(...)`, `from_tokens(...)`."""

    messages: tuple[Message, ...] = ()
    token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.messages and self.token_ids:
            raise ValueError("an Observation is messages or token ids, not both")
        for i, m in enumerate(self.messages):
            _check_message(m, i)
        for t in self.token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"observation token ids must be ints >= 0, got {t!r}")

    @classmethod
    def empty(cls) -> Observation:
        return cls()

    @classmethod
    def from_messages(cls, messages: Sequence[Mapping[str, Any]]) -> Observation:
        return cls(messages=tuple(dict(m) for m in messages))

    @classmethod
    def from_tokens(cls, token_ids: Sequence[int]) -> Observation:
        return cls(token_ids=tuple(token_ids))

    @property
    def kind(self) -> ObservationKind:
        if self.messages:
            return ObservationKind.MESSAGES
        if self.token_ids:
            return ObservationKind.TOKENS
        return ObservationKind.EMPTY


def _check_message(m: Any, i: int) -> None:
    if not isinstance(m, Mapping):
        raise ValueError(f"observation message {i} is a {type(m).__name__}, expected a dict")
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str) or not role:
        raise ValueError(f"observation message {i} needs a non-empty string 'role', got {role!r}")
    if not isinstance(content, str):
        raise ValueError(
            f"observation message {i} ({role}) needs a string 'content', "
            f"got {type(content).__name__}"
        )


@dataclass(frozen=True)
class Action:
    """One model turn: `text` is `token_ids` decoded (special tokens skipped); `truncated`
    when the engine stopped at its token limit rather than at a stop token."""

    text: str
    token_ids: tuple[int, ...] = ()
    truncated: bool = False


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one Action. `reward` is this turn's reward (the final
    reward on the done step; 0.0 on interior turns of end-only environments)."""

    observation: Observation = field(default_factory=Observation)
    reward: float = 0.0
    done: bool = False
    info: dict[str, InfoValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.observation, Observation):
            raise ValueError(
                f"StepResult.observation must be an Observation, got "
                f"{type(self.observation).__name__}"
            )
        try:
            object.__setattr__(self, "reward", reward_number(self.reward))
        except BadReward as exc:
            raise ValueError(f"StepResult.reward: {exc}") from None
        if not isinstance(self.done, bool):
            raise ValueError(f"StepResult.done must be a bool, got {self.done!r}")
        if self.done and self.observation.kind is not ObservationKind.EMPTY:
            # Training data must end on a model turn: an observation after the last turn
            # would be context nothing ever reads (and a masked tail for the estimators).
            raise ValueError("a done StepResult carries no observation (put it in info)")
        for key, value in self.info.items():
            if not isinstance(key, str):
                raise ValueError(f"StepResult.info keys must be strings, got {key!r}")
            if not isinstance(value, float | int | str):
                raise ValueError(
                    f"StepResult.info[{key!r}] must be a number or a string, "
                    f"got {type(value).__name__}"
                )


@runtime_checkable
class Environment(Protocol):
    """Per-trajectory state. Each method may also be `async def`; `close` is optional."""

    def reset(self, record: dict[str, Any]) -> Observation: ...

    def step(self, action: Action) -> StepResult: ...


def is_environment(obj: object) -> bool:
    """Whether `obj` has callable `reset` and `step` (the protocol, sync or async)."""
    return callable(getattr(obj, "reset", None)) and callable(getattr(obj, "step", None))


def _what(method: Callable[..., Any]) -> str:
    owner = getattr(method, "__self__", None)
    name = getattr(method, "__name__", type(method).__name__)
    return f"{type(owner).__name__}.{name}" if owner is not None else name


async def call(
    method: Callable[..., Any],
    *args: Any,
    timeout_s: float | None = None,
    what: str = "",
    setting: str = "timeout_s",
    max_stuck: int | None = None,
) -> Any:
    """Run `method(*args)` whether it is sync or `async def`, bounded by `timeout_s`.

    A coroutine function is awaited under `asyncio.wait_for` (cancelled at the deadline).
    A sync one runs in its own daemon thread (named `hybridflow-env:<what>`): a thread
    cannot be killed, so at the deadline it is abandoned and runs on, never blocking the
    process's exit, and the caller gets EnvTimeout at once. Abandoned calls are counted
    per `what` (stages/deadline.py): while `max_stuck` (default DEFAULT_MAX_STUCK) of
    them are still running, a new sync call of that `what` raises EnvStuckError instead
    of starting one more thread. Exceptions the method raises propagate unchanged (the
    caller decides whether they are the model's mistake or the environment's bug; see
    `env_call`); EnvTimeout names `what` and the `setting` that bounds the wait."""
    what = what or _what(method)
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"{what}: timeout_s must be > 0, got {timeout_s}")
    if inspect.iscoroutinefunction(method):
        aw: Any = method(*args)
        thread = None
    else:
        calls = _daemon_calls(what, setting, max_stuck)
        try:
            thread = calls.start(method, *args, name=f"hybridflow-env:{what}")
        except TooManyStuck as exc:
            raise EnvStuckError(str(exc), what=what) from None
        aw = as_asyncio(thread)
    try:
        result = await asyncio.wait_for(aw, timeout_s)
        if inspect.isawaitable(result):  # a sync callable that returned a coroutine
            result = await asyncio.wait_for(result, timeout_s)
    except asyncio.CancelledError:
        if thread is not None:  # nobody waits for it any more: it counts as abandoned
            calls.abandon(thread)
        raise
    except TimeoutError:
        if thread is not None:
            calls.abandon(thread)
        raise EnvTimeout(
            f"{what} did not return within {timeout_s:g} s (bounded by {setting})", what=what
        ) from None
    return result


async def env_call(
    method: Callable[..., Any],
    *args: Any,
    timeout_s: float | None = None,
    what: str = "",
    setting: str = "timeout_s",
    max_stuck: int | None = None,
) -> Any:
    """`call`, with every failure as the EnvError family: the one place where an
    environment's own exception becomes an EnvError ("<what> raised <Type>: <message>",
    the original as its cause). EnvErrors (timeouts, a remote service's errors) pass
    through as they are. For callers to whom any failure is the environment's."""
    what = what or _what(method)
    try:
        return await call(
            method, *args, timeout_s=timeout_s, what=what, setting=setting, max_stuck=max_stuck
        )
    except EnvError:
        raise
    except Exception as exc:  # the environment's own bug: named, with its cause
        raise EnvError(f"{what} raised {type(exc).__name__}: {exc}", what=what) from exc


DEFAULT_MAX_STUCK = 64  # abandoned sync calls of one `what` still running, at most
_DAEMONS: dict[str, DaemonCalls] = {}
_DAEMONS_LOCK = threading.Lock()


def _daemon_calls(what: str, setting: str, max_stuck: int | None) -> DaemonCalls:
    """The process's abandoned-call count for `what` (one per method or tool name)."""
    cap = DEFAULT_MAX_STUCK if max_stuck is None else max_stuck
    with _DAEMONS_LOCK:
        calls = _DAEMONS.get(what)
        if calls is None:
            calls = _DAEMONS[what] = DaemonCalls(max_stuck=cap, what=what, setting=setting)
        else:  # the latest caller's bound and setting name apply
            if cap < 1:
                raise ValueError(f"{what}: max_stuck must be >= 1, got {cap}")
            calls.max_stuck, calls.setting = cap, setting
    return calls


def stuck_calls(what: str) -> int:
    """Abandoned sync calls of `what` whose threads are still running (for metrics/tests)."""
    with _DAEMONS_LOCK:
        calls = _DAEMONS.get(what)
    return calls.stuck if calls is not None else 0


async def close_env(env: object, *, timeout_s: float | None = None) -> None:
    """Call `env.close()` when it has one (sync or async), bounded like `env_call`."""
    close = getattr(env, "close", None)
    if callable(close):
        await env_call(close, timeout_s=timeout_s)

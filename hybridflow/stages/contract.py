"""The typed stage contract: a role declares each op once; dispatch comes from that.

A role backend subclasses `RoleBase` and marks each op method with `@op(...)`:

    class Reference(RoleBase):
        @op(inputs=SEQUENCE_FIELDS, outputs=("ref_logprobs",))
        def get_logprob(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]: ...

        @op(scope=Scope.STEP)
        def optimizer_step(self, batch, params): ...

        @op(inputs=("prompt_ids", "prompt_mask"), outputs=(...), concurrent=True)
        async def generate(self, batch, params): ...

`RoleBase.__init_subclass__` collects the declarations into `cls.ops` (name -> OpSpec).
From them:
  - the stage host dispatches a task to its method, refuses an op the role does not
    declare (`UnknownOpError`, listing the known ones) and any task before `setup` has
    returned (the host, not each role, guards that);
  - planning and `hybridflow validate` check every dataflow op against the backend's
    declaration (`check_dataflow_op`): unknown op (with a did-you-mean), wrong scope,
    outputs the op does not produce, inputs it needs but is not given, a `params:` key
    the op does not read (`@op(params=...)`). A typo in a preset
    fails before any process starts, naming `dataflow[i].op`.

Concurrency (what the host guarantees: pipeline/host/dispatch.py):
  - `concurrent=True` ops are coroutines awaited on the stage's event loop, several at
    once (up to the coordinator's `max_inflight`); they must not block the loop (a
    rollout engine awaits its own device thread; a reward service awaits HTTP);
  - other ops run one at a time, in arrival order, in the stage's ONE worker thread
    (model code needs no locks);
  - a micro-batch op that is not concurrent waits for its own role's in-flight
    concurrent ops; a step op (optimizer_step, reshard, load_weights, ...) is a barrier
    for the whole process: it starts when every earlier task has finished, and no later
    task starts before it ends (weights never change under a running generate).

Invariants: every op method has the signature `(self, batch: Batch, params: Params) ->
tuple[Batch, Metrics]` (async for concurrent ops); `ops` of a class includes the ops of
its bases.
"""

from __future__ import annotations

import difflib
import enum
import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from hybridflow.errors import BatchError, ConfigError
from hybridflow.transport import aio

F = TypeVar("F", bound=Callable[..., Any])


class Scope(enum.StrEnum):
    MICRO_BATCH = "micro_batch"  # one micro-batch of rows in, the same rows out
    STEP = "step"  # once per step, behind the step barrier (no rows)


@dataclass(frozen=True)
class OpSpec:
    """One op of a role, as declared by its backend."""

    name: str
    method: str  # attribute of the role class that runs it
    scope: Scope | None = Scope.MICRO_BATCH  # None: either (the dataflow decides)
    inputs: tuple[str, ...] = ()  # batch fields the op needs
    outputs: tuple[str, ...] | None = ()  # fields it produces; None: any (declared by config)
    concurrent: bool = False  # an `async def`, several in flight at once
    doc: str = ""
    # Keys of the dataflow op's `params:` the op reads (per-call settings such as
    # generate's sampling overrides); any other key is a typo. None: any key.
    params: tuple[str, ...] | None = ()


_MARK = "__hybridflow_op__"


def op(
    name: str | None = None,
    *,
    scope: Scope | None = Scope.MICRO_BATCH,
    inputs: tuple[str, ...] = (),
    outputs: tuple[str, ...] | None = (),
    concurrent: bool = False,
    params: tuple[str, ...] | None = (),
) -> Callable[[F], F]:
    """Declare the decorated method as op `name` (default: the method's name)."""

    def mark(fn: F) -> F:
        is_async = inspect.iscoroutinefunction(fn)
        if concurrent != is_async:
            kind = "an `async def`" if concurrent else "a plain `def`"
            raise TypeError(
                f"op {name or fn.__name__!r}: concurrent={concurrent} needs {kind} method"
            )
        spec = OpSpec(
            name=name or fn.__name__,
            method=fn.__name__,
            scope=None if scope is None else Scope(scope),
            inputs=tuple(inputs),
            outputs=None if outputs is None else tuple(outputs),
            concurrent=concurrent,
            doc=(inspect.getdoc(fn) or "").split("\n", 1)[0],
            params=None if params is None else tuple(params),
        )
        setattr(fn, _MARK, spec)
        return fn

    return mark


class UnknownOpError(BatchError):
    """A task names an op its role does not declare."""


class RoleNotReadyError(BatchError):
    """A task reached a role before its `setup` returned (or after `close`)."""


class RoleBase:
    """Base class of every role backend (the Role protocol in base.py, made concrete).

    Subclasses override `setup`, and `close`/`state_dict`/`load_state_dict` when they hold
    anything; ops are declared with `@op`. `options_cls` (a dataclass with
    `validate(path)`) is checked at plan time when set."""

    ops: ClassVar[Mapping[str, OpSpec]] = {}
    options_cls: ClassVar[type | None] = None
    # Holds weights an optimizer updates: its replicas must be the ranks of one sharded
    # model (stages/parallel/), never independent copies that would train apart.
    trainable: ClassVar[bool] = False
    # What the runtime may ask of a role, declared by its class: the stage host, the
    # checkpoints and the plan read these instead of probing with hasattr or guessing
    # from a role's name.
    sends_weights: ClassVar[bool] = False  # `weight_buckets()` and `version`: a reshard source
    receives_weights: ClassVar[bool] = False  # `update_weights()`, `load_bucket()`: a rollout
    exports_policy: ClassVar[bool] = False  # its model is the run's policy: a checkpoint's
    # export and the weights a resumed rollout loads (`policy_weights`)
    is_sharded: bool = False  # the ranks of one FSDP model (set up: stages/parallel/role.py)
    writes_shards: bool = False  # checkpointed through save_shards/load_shards (trainers)
    _ready: bool = False  # set when `setup` returns, cleared when `close` starts

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The set-up guard lives here, once, instead of a check in every op of every role.
        if "setup" in vars(cls):
            cls.setup = _after(cls.setup, ready=True)  # type: ignore[method-assign]
        if "close" in vars(cls):
            cls.close = _before(cls.close, ready=False)  # type: ignore[method-assign]
        found: dict[str, OpSpec] = {}
        for klass in reversed(cls.__mro__):
            for attr, value in vars(klass).items():
                spec = getattr(value, _MARK, None)
                if isinstance(spec, OpSpec):
                    found = {k: v for k, v in found.items() if v.method != attr}
                    found[spec.name] = spec
        cls.ops = found

    @classmethod
    def sharded(cls, options: Mapping[str, Any], replicas: int) -> bool:
        """Whether `replicas` of this role are the ranks of one sharded model (every task
        to every rank, rows split) rather than copies sharing the micro-batches. Roles
        with the `fsdp` options (stages/parallel/options.py) decide by them."""
        from hybridflow.stages.parallel.options import ShardingOptions, mode_of, sharded

        opts = cls.options_cls
        if opts is None or not issubclass(opts, ShardingOptions):
            return False
        return sharded(mode_of(options), trainable=cls.trainable, replicas=replicas)

    @classmethod
    def find_op(cls, name: str) -> OpSpec | None:
        """The declaration of op `name`, None if the role has none (a backend that plays
        any op, such as the synthetic one, overrides this)."""
        return cls.ops.get(name)

    @classmethod
    def op_spec(cls, name: str) -> OpSpec:
        """The declaration of op `name`; UnknownOpError (with the known ops) if none."""
        spec = cls.find_op(name)
        if spec is None:
            raise UnknownOpError(
                f"{cls.__name__}: unknown op {name!r}; known: {', '.join(sorted(cls.ops))}"
                + _did_you_mean(name, cls.ops)
            )
        return spec

    def bound_op(self, spec: OpSpec) -> Callable[..., Any]:
        """The callable that runs `spec`: `(batch, params) -> (outputs, metrics)`; raises
        RoleNotReadyError before setup / after close."""
        if not self._ready:
            raise RoleNotReadyError(
                f"{type(self).__name__}.{spec.name} before setup (or after close)"
            )
        return getattr(self, spec.method)

    def handle(self, op_name: str, batch: Any, params: Any) -> Any:
        """Run one op synchronously, as the host would (tests, benchmarks, scripts). A
        concurrent op runs to completion on a private event loop; inside a running loop,
        await `bound_op(spec)(batch, params)` instead."""
        spec = self.op_spec(op_name)
        fn = self.bound_op(spec)
        return aio.run(fn(batch, params)) if spec.concurrent else fn(batch, params)

    # -- life cycle (override as needed) ------------------------------------------------
    def setup(self, ctx: Any) -> None:
        """Build models/engines. Called once, in the stage process, before any task."""

    def close(self) -> None:
        """Free models/engines. Called once at shutdown, even after errors."""

    async def aclose(self) -> None:
        """Release what lives on the stage's event loop (HTTP sessions, sockets opened by
        concurrent ops). The host awaits it on that loop just before `close`."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (weights, optimizer, RNG); {} if stateless."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""


def _after(fn: Callable[..., Any], *, ready: bool) -> Callable[..., Any]:
    if getattr(fn, "_sets_ready", None) is not None:
        return fn

    @functools.wraps(fn)
    def wrapper(self: RoleBase, *args: Any, **kwargs: Any) -> Any:
        out = fn(self, *args, **kwargs)
        self._ready = ready
        return out

    wrapper._sets_ready = ready  # type: ignore[attr-defined]
    return wrapper


def _before(fn: Callable[..., Any], *, ready: bool) -> Callable[..., Any]:
    if getattr(fn, "_sets_ready", None) is not None:
        return fn

    @functools.wraps(fn)
    def wrapper(self: RoleBase, *args: Any, **kwargs: Any) -> Any:
        self._ready = ready
        return fn(self, *args, **kwargs)

    wrapper._sets_ready = ready  # type: ignore[attr-defined]
    return wrapper


def _did_you_mean(name: str, known: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_dataflow_op(
    cls: type[RoleBase],
    *,
    op_name: str,
    scope: str,
    inputs: list[str] | tuple[str, ...],
    outputs: list[str] | tuple[str, ...],
    path: str,
    params: Mapping[str, Any] | None = None,
) -> OpSpec:
    """Check one dataflow op (`path` = its dotted key, e.g. `dataflow[0]`) against the
    backend's declaration; ConfigError naming the key and the fix."""
    spec = cls.find_op(op_name)
    if spec is None:
        raise ConfigError(
            f"{path}.op",
            f"{cls.__name__} has no op {op_name!r}; it has: {', '.join(sorted(cls.ops))}"
            + _did_you_mean(op_name, cls.ops),
        )
    if spec.scope is not None and scope != spec.scope.value:
        raise ConfigError(
            f"{path}.scope",
            f"{cls.__name__}.{op_name} is a {spec.scope.value} op, the dataflow says {scope!r}",
        )
    if spec.outputs is not None:
        extra = [o for o in outputs if o not in spec.outputs]
        if extra:
            raise ConfigError(
                f"{path}.outputs",
                f"{cls.__name__}.{op_name} does not produce {extra}; it produces "
                f"{list(spec.outputs) or 'nothing (metrics only)'}",
            )
    if spec.params is not None:
        for key in params or {}:
            if key not in spec.params:
                known = ", ".join(spec.params) or "none"
                raise ConfigError(
                    f"{path}.params.{key}",
                    f"{cls.__name__}.{op_name} reads no param {key!r}; its params: {known}"
                    + _did_you_mean(key, dict.fromkeys(spec.params)),
                )
    # Ops fed whole by the coordinator list their inputs; a step op without inputs (a
    # weight-link load_weights, an optimizer step) gets none and needs none.
    if inputs:
        missing = [i for i in spec.inputs if i not in inputs]
        if missing:
            raise ConfigError(
                f"{path}.inputs",
                f"{cls.__name__}.{op_name} needs {missing} as inputs (it reads "
                f"{list(spec.inputs)}); add them",
            )
    return spec

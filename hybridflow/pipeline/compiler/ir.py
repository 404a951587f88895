"""The compiler's typed middle: what the frontend proved about a step logic, and what
lowering turns into dataflow ops.

    grammar.parse_logic   text -> Stmt (syntax)
    frontend.analyze      Stmt -> StepIR (names, roles, kinds checked; KL folded)
    lowering.lower        StepIR -> CompiledStep (Topology.dataflow + options)

Every logic value is a `Value` (name, kind, line). Each assigned value has exactly one
`Assign`, the typed record of how it is made:

    Call      role.method(args)              (a bare update has no result)
    Apply     an algorithm function          (ppo_loss, grpo_loss, gae, grpo, ..., value_loss)
    KL        per-token KL                   (kl(a, r, kind=) or `actor_logprob - ref_logprob`)
    Penalty   score - coef * KL              (kl_penalty(s, kl, coef=) or `score - c * kl`)
    Arith     any other arithmetic           (becomes a driver op of its own)
    Alias     `b = a`

Invariants of a StepIR that `analyze` returned: value names are unique; every argument
was assigned on an earlier line (or is an input); argument kinds match the grammar's
tables; each (role, op) is called at most once; every declared output is produced.
Everything here is frozen: lowering reads the IR and never edits it. This module is the
lowest of the compiler's: it imports no other compiler module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridflow.config.schema import DRIVER_ROLE, OpConfig
from hybridflow.errors import CompileError

Scalar = bool | int | float | str | None


@dataclass(frozen=True)
class Value:
    """A named logic value. `kind` is a key of grammar.KINDS; `line` is where it is
    assigned (0: a step input)."""

    name: str
    kind: str
    line: int = 0


@dataclass(frozen=True)
class Call:
    """`role.method(args)`: one op of a runtime role (`actor.generate` is the `rollout`
    role's `generate`). `result` is None for updates; `params` are its keyword options."""

    line: int
    role: str  # runtime role
    op: str
    args: tuple[Value, ...]
    result: Value | None
    params: Mapping[str, Scalar] = field(default_factory=dict)


@dataclass(frozen=True)
class Apply:
    """`result = fn(args..., **options)` with `fn` an algorithm function of the grammar
    (a policy loss, an advantage estimator, value_loss)."""

    line: int
    fn: str
    args: tuple[Value, ...]
    result: Value
    options: Mapping[str, Scalar] = field(default_factory=dict)


@dataclass(frozen=True)
class KL:
    """Per-token KL(policy || reference) [B, R] with estimator k1 | k2 | k3."""

    line: int
    logprob: Value  # kind actor_logprob
    ref_logprob: Value  # kind ref_logprob
    estimator: str
    result: Value


@dataclass(frozen=True)
class Penalty:
    """The score minus `coef` * KL: PPO's KL penalty in the reward. `coef` None: the
    compiler's default coefficient."""

    line: int
    score: Value
    kl: Value
    coef: float | None
    result: Value


@dataclass(frozen=True)
class Arith:
    """Arithmetic over named values (`expr` is its source text, in logic names); `args`
    are the values it reads in first-use order. `per_token`: an operand is [B, R]."""

    line: int
    expr: str
    args: tuple[Value, ...]
    per_token: bool
    result: Value


@dataclass(frozen=True)
class Alias:
    """`result = of`: another name for a value."""

    line: int
    of: Value
    result: Value


Assign = Call | Apply | KL | Penalty | Arith | Alias


@dataclass(frozen=True)
class StepIR:
    """A checked step logic. `assigns` maps each assigned value's name to its definition
    (in line order); `calls` are the role calls (updates included) in line order."""

    inputs: tuple[Value, ...]
    assigns: Mapping[str, Assign]
    calls: tuple[Call, ...]
    outputs: tuple[str, ...]  # as declared: logic names or runtime names (`rewards`)
    roles: frozenset[str]  # runtime roles the builder declared
    lines: tuple[str, ...] = ()  # the logic's source lines, quoted by `error`

    @property
    def values(self) -> dict[str, Value]:
        """Every value by name: inputs first, then assigned values in line order."""
        out = {v.name: v for v in self.inputs}
        for name, a in self.assigns.items():
            assert a.result is not None  # an Assign always binds its result
            out[name] = a.result
        return out

    def call(self, role: str, op: str) -> Call | None:
        return next((c for c in self.calls if c.role == role and c.op == op), None)

    def definition(self, value: Value) -> Assign | None:
        """How `value` is made; None for a step input."""
        return self.assigns.get(value.name)

    def resolve(self, value: Value) -> Value:
        """Follow aliases to the value that is actually computed."""
        d = self.definition(value)
        while isinstance(d, Alias):
            value = d.of
            d = self.definition(value)
        return value

    def error(self, line: int, message: str) -> CompileError:
        """A CompileError at `line` that quotes the source line."""
        source = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return CompileError(line, message, source)


@dataclass(frozen=True)
class StepOutput:
    """Where one declared output's value comes from when a step has run.

    Per-sample values (a response, a score, log-probs, an arithmetic result) are runtime
    tensors with one row per sample that the scheduler collects (`tensor`, [B, ...]);
    step-level values (a loss, a KL folded into the update) exist only as a metric of
    the step (`metric`, e.g. actor/pg_loss). `metric` is also what `Engine.train`
    reports per step for the output ("" : no per-step metric)."""

    kind: str  # grammar.KINDS key of the value
    tensor: str  # runtime tensor holding it per sample ("" : a step-level value)
    metric: str  # the step metric that reports it ("" : none)

    @property
    def per_sample(self) -> bool:
        return bool(self.tensor) or self.kind == "prompt"


@dataclass(frozen=True)
class CompiledStep:
    """What a logic compiles to. `dataflow` is the Topology's op list."""

    dataflow: tuple[OpConfig, ...]
    data_fields: tuple[str, ...]
    role_options: dict[str, dict[str, Any]]  # runtime role -> options the logic implies
    outputs: dict[str, StepOutput]  # declared output -> where its value comes from
    collect: tuple[str, ...]  # runtime tensors the per-sample outputs are read from
    values: dict[str, str]  # logic name -> kind

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(op.role for op in self.dataflow if op.role != DRIVER_ROLE))

    @property
    def trains(self) -> bool:
        """The step updates a role (an `update` op): running it is a training step."""
        return any(op.op == "update" for op in self.dataflow)

    @property
    def samples_per_prompt(self) -> int:
        return int(self.role_options.get("data", {}).get("samples_per_prompt", 1))

"""The step-logic compiler: `DataflowBuilder.define_training_step(logic=...)` -> dataflow ops.

    logic text --ast.parse--> statements --analyze (names, roles, kinds)--> StepIR
               --lower--> Topology.dataflow (OpConfig list) + role options + data fields

The logic is parsed with Python's `ast` and NEVER executed. Allowed, one per line:
  - `name = role.method(values...)`  with the role methods of ROLE_METHODS
    (actor.generate, actor.get_logprob, ref.get_logprob, reward.score, critic.values)
    and bare update calls `actor.update(loss)`, `critic.update(...)`;
  - `name = fn(values..., option=constant)` with fn in ALGORITHMS (ppo_loss, grpo_loss,
    gae, grpo, rloo, reinforce_pp, kl, kl_penalty, value_loss);
  - `name = arithmetic` over named values and numbers (+ - * /, unary minus).
Everything else (imports, attribute chains, loops, conditionals, lambdas, subscripts,
dunder names, unknown functions, re-assignment) is a CompileError naming the line and
the reason. Every value is assigned once and used only after it is assigned; every
declared output must be produced, once, by an op of the step (a loss only exists as the
metric of the update that minimizes it): `CompiledStep.outputs` says where each is read
(a per-sample tensor the scheduler collects, or a step metric), the contract of
`Engine.run`, whose result is keyed by exactly the declared names.

Values have kinds (KINDS: the ONE table from logic names to the runtime's tensor names:
`response` is response_ids/response_mask, a reward score is `rewards`, ...). Lowering
maps each call to an op of its runtime role (actor.generate -> the `rollout` role
colocated with the actor, ref -> `reference`), and the algorithm functions to driver
ops (computed in the coordinator) or to options of the actor/critic update. Ops come
out in one canonical order (generate; scoring ops in role order; driver ops; updates;
step ops), and each op's inputs are exactly what it reads, so independent calls are
concurrent in the scheduler (reward, ref and actor log-prob all start once `response`
exists) and micro-batches stream. Two logics that say the same thing in a different
order compile to the same list.

Modules: grammar.py (the tables and the parser), this one (names, kinds, checks:
`analyze` -> the typed IR of ir.py; `compile_step`), lowering.py (IR -> ops) with
loss.py (the policy loss, resolved).

Invariant: `compile_step` either returns a dataflow that `Topology` validation accepts
(given the roles it was told exist) or raises CompileError; it imports no torch.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow.algos.kl import KL_ALIASES, KL_KINDS
from hybridflow.errors import CompileError
from hybridflow.pipeline.compiler.grammar import (
    ALGORITHMS,
    INPUTS,
    KINDS,
    ROLE_METHODS,
    ROLES,
    Algorithm,
    LogicParser,
    Stmt,
    logic_name,
    parse_logic,
)
from hybridflow.pipeline.compiler.ir import (
    KL,
    Alias,
    Apply,
    Arith,
    Assign,
    Call,
    CompiledStep,
    Penalty,
    Scalar,
    StepIR,
    Value,
)
from hybridflow.pipeline.compiler.lowering import lower
from hybridflow.pipeline.driver import expr as expr_ops

__all__ = [
    "ALGORITHMS",
    "KINDS",
    "ROLES",
    "ROLE_METHODS",
    "CompiledStep",
    "StepIR",
    "analyze",
    "compile_step",
]


def compile_step(
    logic: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    roles: Sequence[str] | Mapping[str, Any],
) -> CompiledStep:
    """Compile `logic` for a builder that declared runtime `roles` (actor, rollout,
    reference, critic, reward). Raises CompileError (a ConfigError) naming the line."""
    return lower(analyze(logic, inputs, outputs, roles))


def analyze(
    logic: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    roles: Sequence[str] | Mapping[str, Any],
) -> StepIR:
    """Parse and check `logic` (names, roles, argument kinds, options) -> its typed IR.
    Raises CompileError naming the line."""
    front, stmts = parse_logic(logic)
    return _Checker(front, stmts, tuple(inputs), tuple(outputs), frozenset(roles)).run()


class _Checker:
    def __init__(
        self,
        front: LogicParser,
        stmts: list[Stmt],
        inputs: tuple[str, ...],
        outputs: tuple[str, ...],
        roles: frozenset[str],
    ) -> None:
        self.front, self.stmts = front, stmts
        self.inputs, self.outputs, self.roles = inputs, outputs, roles
        self.env: dict[str, Value] = {}
        self.assigns: dict[str, Assign] = {}
        self.calls: dict[tuple[str, str], Call] = {}  # (role, op) -> the call

    def err(self, where: Stmt | int, message: str) -> CompileError:
        return self.front.error(where.line if isinstance(where, Stmt) else where, message)

    # -- checks -------------------------------------------------------------------------
    def run(self) -> StepIR:
        if not self.inputs:
            raise CompileError(0, "inputs must name at least one data value, e.g. ['prompt']")
        step_inputs = []
        for name in self.inputs:
            if name not in INPUTS:
                raise CompileError(
                    0,
                    f"input {name!r} is not a value the data source provides; use one of "
                    f"{', '.join(INPUTS)}",
                )
            self.env[name] = Value(name, INPUTS[name], 0)
            step_inputs.append(self.env[name])
        for st in self.stmts:
            self._statement(st)
        for i, name in enumerate(self.outputs):
            if name in self.outputs[:i]:
                raise CompileError(0, f"output {name!r} is declared twice; name it once")
            self._resolve_output(name)
        return StepIR(
            inputs=tuple(step_inputs),
            assigns=dict(self.assigns),
            calls=tuple(self.calls.values()),
            outputs=self.outputs,
            roles=self.roles,
            lines=tuple(self.front.lines),
        )

    def _use(self, st: Stmt, name: str) -> Value:
        value = self.env.get(name)
        if value is None:
            later = next((s.line for s in self.stmts if s.target == name), None)
            if later is not None:
                raise self.err(st, f"{name!r} is used before it is assigned (on line {later})")
            raise self.err(
                st,
                f"{name!r} is not defined; inputs are {', '.join(self.inputs)} and values are "
                "assigned before use",
            )
        return value

    def _new(self, st: Stmt, kind: str) -> Value:
        """The value `st` assigns (checked: a fresh name that is no role or function)."""
        assert st.target is not None
        name = st.target
        if name in self.env:
            first = self.env[name].line
            where = "an input" if first == 0 else f"assigned on line {first}"
            raise self.err(st, f"{name!r} is {where}; every value is assigned exactly once")
        if name in ROLES or name in ALGORITHMS:
            raise self.err(st, f"{name!r} names a role or function; pick another value name")
        return Value(name, kind, st.line)

    def _bind(self, assign: Assign) -> None:
        result = assign.result
        assert result is not None
        self.env[result.name] = result
        self.assigns[result.name] = assign

    def _match(self, st: Stmt, what: str, accepted: tuple[tuple[str, ...], ...]) -> list[Value]:
        args = [self._use(st, a) for a in st.args]
        kinds = tuple(v.kind for v in args)
        if kinds not in accepted:
            got = ", ".join(f"{v.name}: {v.kind}" for v in args) or "nothing"
            want = " | ".join("(" + ", ".join(a) + ")" for a in accepted)
            raise self.err(st, f"{what} takes {want}; got ({got})")
        return args

    def _statement(self, st: Stmt) -> None:
        if st.form == "role":
            self._role_call(st)
        elif st.form == "algo":
            self._algorithm(st)
        else:
            self._arith(st)

    def _role_call(self, st: Stmt) -> None:
        m = ROLE_METHODS[(st.role, st.method)]
        label = f"{logic_name(st.role)}.{st.method}"
        needed = m.runtime_role
        if needed not in self.roles:
            raise self.err(st, f"{label} needs a {_ADDER.get(needed, needed)}; none was added")
        args = self._match(st, label, m.args)
        bad = [k for k, _ in st.kwargs if k not in m.options]
        if bad:
            raise self.err(
                st,
                f"{label} takes no option {bad[0]!r}"
                + (f"; options: {', '.join(m.options)}" if m.options else ""),
            )
        if (m.runtime_role, m.op) in self.calls:
            first = self.calls[(m.runtime_role, m.op)].line
            raise self.err(st, f"{label} is already called on line {first}; call it once per step")
        if m.result is None:
            if st.target is not None:
                raise self.err(st, f"{label} returns nothing; call it without `name =`")
            result = None
        elif st.target is None:
            raise self.err(st, f"the result of {label} is dropped; assign it to a name")
        else:
            result = self._new(st, m.result)
        call = Call(st.line, m.runtime_role, m.op, tuple(args), result, dict(st.kwargs))
        self.calls[(m.runtime_role, m.op)] = call
        if result is not None:
            self._bind(call)

    def _algorithm(self, st: Stmt) -> None:
        algo = ALGORITHMS[st.method]
        if st.target is None:
            raise self.err(st, f"the result of {st.method}(...) is dropped; assign it to a name")
        args = self._match(st, f"{st.method}(...)", algo.args)
        opts = self._options(st, algo)
        if st.method == "kl":
            estimator = _kl_kind(self, st, opts.get("kind", "k3"))
            self._bind(KL(st.line, args[0], args[1], estimator, self._new(st, algo.result)))
            return
        result = self._new(st, algo.result)
        if st.method == "kl_penalty":
            coef = opts.get("kl_coef")
            if coef is not None and _number_option(coef) is None:
                raise self.err(st, f"kl_penalty(): kl_coef= must be a number, got {coef!r}")
            self._bind(Penalty(st.line, args[0], args[1], _number_option(coef), result))
        else:
            self._bind(Apply(st.line, st.method, tuple(args), result, opts))

    def _options(self, st: Stmt, algo: Algorithm) -> dict[str, Scalar]:
        """The keyword options of an algorithm call by the names they set (an older
        spelling resolved to its option); CompileError for an unknown one or one given
        twice under two spellings."""
        out: dict[str, Scalar] = {}
        spelled: dict[str, str] = {}
        for key, value in st.kwargs:
            name = algo.option(key)
            if not name:
                raise self.err(
                    st,
                    f"{st.method}() has no option {key!r}; options: {', '.join(algo.options)}",
                )
            if name in out:
                raise self.err(
                    st, f"{spelled[name]}= and {key}= set the same option ({name}); give it once"
                )
            out[name], spelled[name] = value, key
        return out

    def _arith(self, st: Stmt) -> None:
        assert st.expr is not None
        args = [self._use(st, n) for n in expr_ops.names_in(st.expr)]
        folded = _fold_arith(self, st)
        if folded is not None:
            self._bind(folded)
            return
        if isinstance(st.expr, ast.Name):  # an alias
            src = self.env[st.expr.id]
            self._bind(Alias(st.line, src, self._new(st, src.kind)))
            return
        kinds = {v.kind for v in args}
        per_token = {"actor_logprob", "ref_logprob", "values", "advantages"}
        for v in args:
            if not KINDS[v.kind].fields and v.kind != "tensor":
                raise self.err(
                    st,
                    f"{v.name} ({v.kind}) is not a tensor the dataflow carries; arithmetic "
                    "works on scores, log-probs, values and advantages",
                )
            if v.kind in ("prompt", "response"):
                raise self.err(st, f"{v.name} is a token sequence; arithmetic on it means nothing")
        kind = "score" if kinds == {"score"} else "tensor"
        result = self._new(st, kind)
        self._bind(
            Arith(st.line, ast.unparse(st.expr), tuple(args), bool(kinds & per_token), result)
        )

    def _resolve_output(self, name: str) -> None:
        if name in self.env:
            return
        for value in self.env.values():  # a runtime name of a produced value (`rewards`)
            if name in KINDS[value.kind].fields:
                return
        produced = [n for n in self.env if n not in self.inputs]
        raise CompileError(
            0,
            f"output {name!r} is never produced by the logic; produced values: "
            f"{', '.join(produced) or '(none)'}",
        )


_ADDER = {
    "rollout": "actor (df.add_actor)",
    "actor": "actor (df.add_actor)",
    "reference": "reference model (df.add_reference_model)",
    "critic": "critic (df.add_critic)",
    "reward": "reward (df.add_reward_model / add_reward_function / add_reward_service)",
}


def _kl_kind(checker: _Checker, st: Stmt, kind: Scalar) -> str:
    kind = KL_ALIASES.get(kind, kind) if isinstance(kind, str) else kind
    if kind not in KL_KINDS:
        kinds = f"{', '.join(KL_KINDS[:-1])} or {KL_KINDS[-1]}"
        aliases = ", ".join(KL_ALIASES)
        raise checker.err(st, f"KL kind must be {kinds} (or {aliases}); got {kind!r}")
    return str(kind)


def _fold_arith(checker: _Checker, st: Stmt) -> KL | Penalty | None:
    """Patterns with a meaning of their own (not a generic driver op):
    actor_logprob - ref_logprob       -> KL (k1 estimator)
    score - c * kl | score - kl * c | score - kl   -> Penalty (a KL penalty of coef c)
    """
    env = checker.env
    node = st.expr

    def value(n: ast.expr) -> Value | None:
        return env.get(n.id) if isinstance(n, ast.Name) else None

    def kind(n: ast.expr) -> str | None:
        v = value(n)
        return v.kind if v is not None else None

    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)):
        return None
    left, right = value(node.left), node.right
    if left is None:
        return None
    if left.kind == "actor_logprob" and kind(right) == "ref_logprob":
        ref = value(right)
        assert ref is not None
        return KL(st.line, left, ref, "k1", checker._new(st, "kl"))
    if left.kind != "score":
        return None
    coef: float | None = None
    kl: Value | None = None
    if kind(right) == "kl":
        coef, kl = 1.0, value(right)
    elif isinstance(right, ast.BinOp) and isinstance(right.op, ast.Mult):
        a, b = right.left, right.right
        if kind(a) == "kl" and _number(b) is not None:
            kl, coef = value(a), _number(b)
        elif kind(b) == "kl" and _number(a) is not None:
            kl, coef = value(b), _number(a)
    if kl is None or coef is None:
        return None
    return Penalty(st.line, left, kl, coef, checker._new(st, "score"))


def _number(node: ast.expr) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return None if isinstance(node.value, bool) else float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _number(node.operand)
        return None if v is None else -v
    return None


def _number_option(value: Scalar) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None

"""The step-logic compiler: `DataflowBuilder.define_training_step(logic=...)` -> dataflow ops.

    logic text --ast.parse--> statements --check (names, roles, kinds)--> typed values
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
declared output must be produced.

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

Modules: step_grammar.py (the tables and the parser), this one (names, kinds, checks:
`compile_step`), lowering.py (typed values -> ops).

Invariant: `compile_step` either returns a dataflow that `Topology` validation accepts
(given the roles it was told exist) or raises CompileError; it imports no torch.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow.errors import CompileError
from hybridflow.pipeline.compiler import expr as expr_ops
from hybridflow.pipeline.compiler.grammar import (
    ALGORITHMS,
    INPUTS,
    KINDS,
    ROLE_METHODS,
    ROLES,
    CompiledStep,
    LogicParser,
    Stmt,
    Sym,
    parse_logic,
)
from hybridflow.pipeline.compiler.lowering import lower

__all__ = ["ALGORITHMS", "KINDS", "ROLES", "ROLE_METHODS", "CompiledStep", "compile_step"]


def compile_step(
    logic: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    roles: Sequence[str] | Mapping[str, Any],
) -> CompiledStep:
    """Compile `logic` for a builder that declared runtime `roles` (actor, rollout,
    reference, critic, reward). Raises CompileError (a ConfigError) naming the line."""
    front, stmts = parse_logic(logic)
    return _Compiler(front, stmts, tuple(inputs), tuple(outputs), set(roles)).run()


class _Compiler:
    def __init__(
        self,
        front: LogicParser,
        stmts: list[Stmt],
        inputs: tuple[str, ...],
        outputs: tuple[str, ...],
        roles: set[str],
    ) -> None:
        self.front, self.stmts = front, stmts
        self.inputs, self.outputs, self.roles = inputs, outputs, roles
        self.env: dict[str, Sym] = {}
        self.calls: dict[tuple[str, str], Stmt] = {}  # (role, op) -> its statement
        self.updates: dict[str, Sym] = {}  # "actor"/"critic" -> what the update consumes

    def err(self, where: Stmt | int, message: str) -> CompileError:
        return self.front.error(where.line if isinstance(where, Stmt) else where, message)

    # -- checks -------------------------------------------------------------------------
    def run(self) -> CompiledStep:
        if not self.inputs:
            raise CompileError(0, "inputs must name at least one data value, e.g. ['prompt']")
        for name in self.inputs:
            if name not in INPUTS:
                raise CompileError(
                    0,
                    f"input {name!r} is not a value the data source provides; use one of "
                    f"{', '.join(INPUTS)}",
                )
            self.env[name] = Sym(name, INPUTS[name], 0)
        for st in self.stmts:
            self._statement(st)
        for name in self.outputs:
            self._resolve_output(name)
        return lower(self)

    def _use(self, st: Stmt, name: str) -> Sym:
        sym = self.env.get(name)
        if sym is None:
            later = next((s.line for s in self.stmts if s.target == name), None)
            if later is not None:
                raise self.err(st, f"{name!r} is used before it is assigned (on line {later})")
            raise self.err(
                st,
                f"{name!r} is not defined; inputs are {', '.join(self.inputs)} and values are "
                "assigned before use",
            )
        sym.used = True
        return sym

    def _bind(self, st: Stmt, kind: str, info: dict[str, Any]) -> None:
        assert st.target is not None
        name = st.target
        if name in self.env:
            first = self.env[name].line
            where = "an input" if first == 0 else f"assigned on line {first}"
            raise self.err(st, f"{name!r} is {where}; every value is assigned exactly once")
        if name in ROLES or name in ALGORITHMS:
            raise self.err(st, f"{name!r} names a role or function; pick another value name")
        self.env[name] = Sym(name, kind, st.line, info)

    def _match(self, st: Stmt, what: str, accepted: tuple[tuple[str, ...], ...]) -> list[Sym]:
        syms = [self._use(st, a) for a in st.args]
        kinds = tuple(s.kind for s in syms)
        if kinds not in accepted:
            got = ", ".join(f"{s.name}: {s.kind}" for s in syms) or "nothing"
            want = " | ".join("(" + ", ".join(a) + ")" for a in accepted)
            raise self.err(st, f"{what} takes {want}; got ({got})")
        return syms

    def _statement(self, st: Stmt) -> None:
        if st.form == "role":
            self._role_call(st)
        elif st.form == "algo":
            self._algorithm(st)
        else:
            self._arith(st)

    def _role_call(self, st: Stmt) -> None:
        m = ROLE_METHODS[(st.role, st.method)]
        label = f"{_logic_role(st.role)}.{st.method}"
        needed = m.runtime_role
        if needed not in self.roles:
            raise self.err(st, f"{label} needs a {_ADDER.get(needed, needed)}; none was added")
        syms = self._match(st, label, m.args)
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
        self.calls[(m.runtime_role, m.op)] = st
        if m.result is None:
            if st.target is not None:
                raise self.err(st, f"{label} returns nothing; call it without `name =`")
            self.updates[m.runtime_role] = syms[0]
            return
        if st.target is None:
            raise self.err(st, f"the result of {label} is dropped; assign it to a name")
        self._bind(st, m.result, {"args": syms, "params": dict(st.kwargs)})

    def _algorithm(self, st: Stmt) -> None:
        algo = ALGORITHMS[st.method]
        if st.target is None:
            raise self.err(st, f"the result of {st.method}(...) is dropped; assign it to a name")
        syms = self._match(st, f"{st.method}(...)", algo.args)
        opts = dict(st.kwargs)
        bad = [k for k in opts if k not in algo.options]
        if bad:
            raise self.err(
                st, f"{st.method}() has no option {bad[0]!r}; options: {', '.join(algo.options)}"
            )
        info: dict[str, Any] = {"fn": st.method, "args": syms, "opts": opts}
        if st.method == "kl":
            info["estimator"] = _kl_kind(self, st, opts.get("kind", "k3"))
        self._bind(st, algo.result, info)

    def _arith(self, st: Stmt) -> None:
        assert st.expr is not None
        syms = [self._use(st, n) for n in expr_ops.names_in(st.expr)]
        folded = _fold_arith(st.expr, self.env)
        if folded is not None:
            kind, info = folded
            self._bind(st, kind, info)
            return
        if isinstance(st.expr, ast.Name):  # an alias
            src = self.env[st.expr.id]
            assert st.target is not None
            self._bind(st, src.kind, dict(src.info, alias_of=src))
            return
        kinds = {s.kind for s in syms}
        per_token = {"actor_logprob", "ref_logprob", "values", "advantages"}
        for s in syms:
            if not KINDS[s.kind].fields and s.kind != "tensor":
                raise self.err(
                    st,
                    f"{s.name} ({s.kind}) is not a tensor the dataflow carries; arithmetic "
                    "works on scores, log-probs, values and advantages",
                )
            if s.kind in ("prompt", "response"):
                raise self.err(st, f"{s.name} is a token sequence; arithmetic on it means nothing")
        kind = "score" if kinds == {"score"} else "tensor"
        self._bind(
            st,
            kind,
            {"expr": st.expr, "args": syms, "per_token": bool(kinds & per_token)},
        )

    def _resolve_output(self, name: str) -> None:
        if name in self.env:
            return
        for sym in self.env.values():  # a runtime name of a produced value (`rewards`)
            if name in KINDS[sym.kind].fields:
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


def _logic_role(runtime_role: str) -> str:
    return "ref" if runtime_role == "reference" else runtime_role


def _kl_kind(comp: _Compiler, st: Stmt, kind: Any) -> str:
    aliases = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
    kind = aliases.get(kind, kind)
    if kind not in ("k1", "k2", "k3"):
        raise comp.err(st, f"KL kind must be k1, k2 or k3 (or kl, mse, low_var_kl); got {kind!r}")
    return str(kind)


def _fold_arith(node: ast.expr, env: dict[str, Sym]) -> tuple[str, dict[str, Any]] | None:
    """Patterns with a meaning of their own (not a generic driver op):
    actor_logprob - ref_logprob       -> kl (k1 estimator)
    score - c * kl | score - kl * c | score - kl   -> score with a KL penalty (coef c)
    """

    def kind(n: ast.expr) -> str | None:
        return env[n.id].kind if isinstance(n, ast.Name) and n.id in env else None

    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)):
        return None
    left, right = node.left, node.right
    if kind(left) == "actor_logprob" and kind(right) == "ref_logprob":
        assert isinstance(left, ast.Name) and isinstance(right, ast.Name)
        return "kl", {
            "fn": "logprob_diff",
            "args": [env[left.id], env[right.id]],
            "estimator": "k1",
        }
    if kind(left) != "score":
        return None
    assert isinstance(left, ast.Name)
    coef: float | None = None
    kl_name: str | None = None
    if kind(right) == "kl":
        assert isinstance(right, ast.Name)
        coef, kl_name = 1.0, right.id
    elif isinstance(right, ast.BinOp) and isinstance(right.op, ast.Mult):
        a, b = right.left, right.right
        if kind(a) == "kl" and _number(b) is not None:
            kl_name, coef = a.id, _number(b)  # type: ignore[attr-defined]
        elif kind(b) == "kl" and _number(a) is not None:
            kl_name, coef = b.id, _number(a)  # type: ignore[attr-defined]
    if kl_name is None or coef is None:
        return None
    return "score", {
        "fn": "kl_penalty",
        "args": [env[left.id], env[kl_name]],
        "opts": {"coef": coef},
    }


def _number(node: ast.expr) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return None if isinstance(node.value, bool) else float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _number(node.operand)
        return None if v is None else -v
    return None

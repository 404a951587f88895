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

Invariant: `compile_step` either returns a dataflow that `Topology` validation accepts
(given the roles it was told exist) or raises CompileError; it imports no torch.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridflow.config.schema import DRIVER_ROLE, OpConfig
from hybridflow.errors import CompileError
from hybridflow.pipeline import expr as expr_ops

Scalar = bool | int | float | str | None

# ---------------------------------------------------------------------------------------
# THE name table: what a logic value stands for on the wire.


@dataclass(frozen=True)
class Kind:
    fields: tuple[str, ...]  # runtime tensors the value stands for
    metric: str  # the per-step metric that reports it when declared an output
    doc: str


KINDS: dict[str, Kind] = {
    "prompt": Kind(("prompt_ids", "prompt_mask"), "", "prompts from the data source"),
    "response": Kind(
        ("response_ids", "response_mask"), "response_length/mean", "sampled responses"
    ),
    "score": Kind(("rewards",), "reward/mean", "one reward per sample [B]"),
    "actor_logprob": Kind(("old_logprobs",), "", "log pi(token) [B, R] before the update"),
    "ref_logprob": Kind(("ref_logprobs",), "", "log pi_ref(token) [B, R]"),
    "values": Kind(("values",), "critic/vpred_mean", "critic values [B, R]"),
    "kl": Kind((), "actor/kl", "per-token KL to the reference (folded into its consumer)"),
    "advantages": Kind(("advantages",), "", "advantages [B, R] (+ returns with GAE)"),
    "policy_loss": Kind((), "actor/pg_loss", "the policy loss (an actor.update setting)"),
    "value_loss": Kind((), "critic/vf_loss", "the value loss (a critic.update setting)"),
    "tensor": Kind((), "", "arithmetic result (a driver op output of its own name)"),
}

# Names `inputs=[...]` may use -> kind. Data fields the runtime reads for them:
INPUTS: dict[str, str] = {"prompt": "prompt", "prompts": "prompt"}
DATA_FIELDS = ("prompt_ids", "prompt_mask", "metadata_json")

# Logic role names -> runtime role names (topology roles).
ROLES: dict[str, str] = {
    "actor": "actor",
    "ref": "reference",
    "reference": "reference",
    "critic": "critic",
    "reward": "reward",
}


@dataclass(frozen=True)
class Method:
    runtime_role: str
    op: str
    args: tuple[tuple[str, ...], ...]  # accepted positional kind lists
    result: str | None  # kind, None for updates
    options: tuple[str, ...] = ()  # keyword options (-> op params)


_SEQ_ARGS = (("prompt", "response"), ("response",))
ROLE_METHODS: dict[tuple[str, str], Method] = {
    ("actor", "generate"): Method(
        "rollout",
        "generate",
        (("prompt",),),
        "response",
        ("temperature", "top_p", "top_k", "max_new_tokens", "n"),
    ),
    ("actor", "get_logprob"): Method("actor", "get_logprob", _SEQ_ARGS, "actor_logprob"),
    ("actor", "update"): Method("actor", "update", (("policy_loss",),), None),
    ("reference", "get_logprob"): Method("reference", "get_logprob", _SEQ_ARGS, "ref_logprob"),
    ("reward", "score"): Method("reward", "score", _SEQ_ARGS, "score"),
    ("critic", "values"): Method("critic", "values", _SEQ_ARGS, "values"),
    ("critic", "update"): Method("critic", "update", (("value_loss",), ("advantages",)), None),
}


@dataclass(frozen=True)
class Algorithm:
    args: tuple[tuple[str, ...], ...]  # accepted positional kind lists
    result: str
    options: tuple[str, ...]
    doc: str


_LOSS_OPTIONS = (
    "clip_ratio",
    "clip_ratio_low",
    "clip_ratio_high",
    "dual_clip_c",
    "entropy_coef",
    "kl_coef",
    "kl_type",
)
ALGORITHMS: dict[str, Algorithm] = {
    "ppo_loss": Algorithm(
        (("score",), ("score", "kl"), ("advantages",), ("advantages", "kl")),
        "policy_loss",
        (*_LOSS_OPTIONS, "estimator", "gamma", "lam", "whiten", "norm_std"),
        "PPO clip loss; from a score it estimates advantages (GAE with a critic, else "
        "`estimator`); a KL argument becomes a penalty in the reward",
    ),
    "grpo_loss": Algorithm(
        (("score",), ("score", "kl")),
        "policy_loss",
        (*_LOSS_OPTIONS, "norm_std", "estimator"),
        "PPO clip loss on group-normalised advantages; a KL argument becomes a loss term",
    ),
    "gae": Algorithm(
        (("score", "values"),), "advantages", ("gamma", "lam", "whiten"), "GAE advantages"
    ),
    "grpo": Algorithm((("score",),), "advantages", ("norm_std",), "GRPO group advantages"),
    "rloo": Algorithm((("score",),), "advantages", (), "RLOO leave-one-out advantages"),
    "reinforce_pp": Algorithm((("score",),), "advantages", ("gamma",), "REINFORCE++"),
    "kl": Algorithm((("actor_logprob", "ref_logprob"),), "kl", ("kind",), "per-token KL estimate"),
    "kl_penalty": Algorithm(
        (("score", "kl"),), "score", ("coef",), "the reward minus coef * KL (PPO penalty)"
    ),
    "value_loss": Algorithm(
        (("values", "advantages"), ("advantages",)),
        "value_loss",
        ("cliprange_value",),
        "clipped value loss on the returns",
    ),
}

# Defaults of the RL semantics (the bundled presets use the same).
DEFAULTS: dict[str, Any] = {
    "gamma": 1.0,
    "lam": 1.0,
    "kl_coef": 0.001,
    "kl_type_penalty": "k1",
    "kl_type_loss": "k3",
    "norm_std": True,
}

_REJECT: dict[type[ast.AST], str] = {
    ast.Import: "imports are not allowed: the logic names roles and algorithm functions only",
    ast.ImportFrom: "imports are not allowed: the logic names roles and algorithm functions only",
    ast.For: "loops are not allowed: the runtime iterates over micro-batches and steps itself",
    ast.AsyncFor: "loops are not allowed: the runtime iterates over micro-batches and steps",
    ast.While: "loops are not allowed: the runtime iterates over micro-batches and steps itself",
    ast.If: "conditionals are not allowed: a step is one fixed dataflow",
    ast.IfExp: "conditionals are not allowed: a step is one fixed dataflow",
    ast.Lambda: "lambdas are not allowed",
    ast.FunctionDef: "function definitions are not allowed",
    ast.AsyncFunctionDef: "function definitions are not allowed",
    ast.ClassDef: "class definitions are not allowed",
    ast.With: "with-blocks are not allowed",
    ast.AsyncWith: "with-blocks are not allowed",
    ast.Try: "try-blocks are not allowed",
    ast.Raise: "raise is not allowed",
    ast.Return: "return is not allowed",
    ast.Delete: "del is not allowed",
    ast.Global: "global is not allowed",
    ast.Nonlocal: "nonlocal is not allowed",
    ast.Assert: "assert is not allowed",
    ast.AugAssign: "augmented assignment re-binds a value; every value is assigned once",
    ast.AnnAssign: "annotated assignment is not allowed; write `name = ...`",
    ast.Subscript: "subscripts are not allowed: name the value you need",
    ast.Starred: "star arguments are not allowed",
    ast.ListComp: "comprehensions are not allowed",
    ast.SetComp: "comprehensions are not allowed",
    ast.DictComp: "comprehensions are not allowed",
    ast.GeneratorExp: "comprehensions are not allowed",
    ast.List: "containers are not allowed: one value per name",
    ast.Tuple: "tuples are not allowed: one value per name",
    ast.Dict: "containers are not allowed",
    ast.Set: "containers are not allowed",
    ast.Compare: "comparisons are not allowed",
    ast.BoolOp: "boolean operators are not allowed",
    ast.NamedExpr: "assignment expressions are not allowed",
    ast.Await: "await is not allowed",
    ast.Yield: "yield is not allowed",
    ast.YieldFrom: "yield is not allowed",
    ast.JoinedStr: "f-strings are not allowed",
}

# ---------------------------------------------------------------------------------------
# Front end: text -> statements (syntax only; nothing is evaluated)


@dataclass(frozen=True)
class Stmt:
    line: int
    source: str
    target: str | None  # None: a bare update call
    form: str  # "role" | "algo" | "arith"
    role: str = ""  # runtime role of a role call
    method: str = ""  # role method or algorithm function
    args: tuple[str, ...] = ()
    kwargs: tuple[tuple[str, Scalar], ...] = ()
    expr: ast.expr | None = None  # arithmetic


class _Front:
    def __init__(self, text: str) -> None:
        self.text = textwrap.dedent(text).strip("\n")
        self.lines = self.text.splitlines()

    def error(self, node: ast.AST | int, message: str) -> CompileError:
        line = node if isinstance(node, int) else getattr(node, "lineno", 0)
        source = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return CompileError(line, message, source)

    def parse(self) -> list[Stmt]:
        try:
            tree = ast.parse(self.text, mode="exec")
        except SyntaxError as exc:
            raise self.error(exc.lineno or 0, f"not valid Python syntax: {exc.msg}") from None
        self._no_dunders(tree)
        out = []
        for node in tree.body:
            stmt = self._statement(node)
            if stmt is not None:
                out.append(stmt)
        if not out:
            raise CompileError(
                0, "the logic is empty: write at least `response = actor.generate(prompt)`"
            )
        return out

    def _no_dunders(self, tree: ast.AST) -> None:
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Name):
                names.append(node.id)
            elif isinstance(node, ast.Attribute):
                names.append(node.attr)
            elif isinstance(node, ast.keyword) and node.arg:
                names.append(node.arg)
            for n in names:
                if n.startswith("__"):
                    raise self.error(node, f"dunder names are not allowed ({n!r})")

    def _reject(self, node: ast.AST) -> CompileError:
        reason = _REJECT.get(type(node), f"{type(node).__name__} is not allowed here")
        return self.error(node, reason)

    def _statement(self, node: ast.stmt) -> Stmt | None:
        src = ast.get_source_segment(self.text, node) or ""
        if isinstance(node, ast.Pass):
            return None
        if isinstance(node, ast.Expr):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                return None  # a docstring / string comment
            if isinstance(node.value, ast.Call):
                return self._call(node.value, None, src)
            raise self.error(node, "a bare expression does nothing; assign it to a name")
        if isinstance(node, ast.Assign):
            if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
                raise self.error(node, "assign to exactly one plain name (`x = ...`)")
            target = node.targets[0].id
            value = node.value
            if isinstance(value, ast.Call):
                return self._call(value, target, src)
            if isinstance(value, (ast.BinOp, ast.UnaryOp, ast.Name)):
                reason = expr_ops.check_expr(value)
                if reason:
                    bad = next(
                        (
                            n
                            for n in ast.walk(value)
                            if type(n) in _REJECT or isinstance(n, ast.Attribute)
                        ),
                        None,
                    )
                    if bad is not None:
                        raise (
                            self._reject(bad)
                            if type(bad) in _REJECT
                            else self.error(
                                bad, "attributes are only allowed as role.method(...) calls"
                            )
                        )
                    raise self.error(node, reason)
                return Stmt(node.lineno, src, target, "arith", expr=value)
            if isinstance(value, ast.Constant):
                raise self.error(
                    node,
                    "a constant alone is not a dataflow value; use numbers inside arithmetic "
                    "or as keyword options (e.g. ppo_loss(score, kl_coef=0.05))",
                )
            if isinstance(value, ast.Attribute):
                raise self.error(node, "attributes are only allowed as role.method(...) calls")
            raise self._reject(value)
        raise self._reject(node)

    def _call(self, call: ast.Call, target: str | None, src: str) -> Stmt:
        func = call.func
        kwargs = self._kwargs(call)
        if isinstance(func, ast.Attribute):
            if not isinstance(func.value, ast.Name):
                raise self.error(call, "attribute chains are not allowed: call role.method(...)")
            who, method = func.value.id, func.attr
            if who not in ROLES:
                raise self.error(
                    call,
                    f"{who}.{method}: attributes of other objects are not allowed; the roles "
                    f"are {', '.join(sorted(set(ROLES) - {'reference'}))}",
                )
            role = ROLES[who]
            if (role, method) not in ROLE_METHODS:
                known = sorted(m for (r, m) in ROLE_METHODS if r == role)
                raise self.error(
                    call, f"{who}.{method} is not a method of {who}; known: {', '.join(known)}"
                )
            form = "role"
        elif isinstance(func, ast.Name):
            role, method = "", func.id
            if method not in ALGORITHMS:
                raise self.error(
                    call,
                    f"unknown function {method!r}; allowed: {', '.join(sorted(ALGORITHMS))} "
                    "and role methods",
                )
            form = "algo"
        else:
            raise self._reject(func)
        args = []
        for a in call.args:
            if isinstance(a, ast.Name):
                args.append(a.id)
            elif type(a) in _REJECT:
                raise self._reject(a)
            else:
                raise self.error(
                    a, "arguments must be value names; assign arithmetic to a name first"
                )
        return Stmt(call.lineno, src, target, form, role, method, tuple(args), kwargs)

    def _kwargs(self, call: ast.Call) -> tuple[tuple[str, Scalar], ...]:
        out = []
        for kw in call.keywords:
            if kw.arg is None:
                raise self.error(call, "**options are not allowed; write each option out")
            out.append((kw.arg, self._constant(kw.value, kw.arg)))
        return tuple(out)

    def _constant(self, node: ast.expr, name: str) -> Scalar:
        if isinstance(node, ast.Constant) and isinstance(node.value, (bool, int, float, str)):
            return node.value
        if isinstance(node, ast.Constant) and node.value is None:
            return None
        if (
            isinstance(node, ast.UnaryOp)
            and isinstance(node.op, ast.USub)
            and isinstance(node.operand, ast.Constant)
            and isinstance(node.operand.value, (int, float))
            and not isinstance(node.operand.value, bool)
        ):
            return -node.operand.value
        raise self.error(
            node, f"option {name}= must be a constant (number, string, True/False/None)"
        )


# ---------------------------------------------------------------------------------------
# Middle: names and kinds. Each value is a symbol; folding (KL into its consumer, a
# score's penalty into the advantage op) happens on symbols, so nothing is emitted twice.


@dataclass
class Sym:
    name: str
    kind: str
    line: int
    # what it is made of (kind-specific):
    info: dict[str, Any] = field(default_factory=dict)
    used: bool = False


@dataclass(frozen=True)
class CompiledStep:
    """What a logic compiles to. `dataflow` is the Topology's op list."""

    dataflow: tuple[OpConfig, ...]
    data_fields: tuple[str, ...]
    role_options: dict[str, dict[str, Any]]  # runtime role -> options the logic implies
    outputs: dict[str, str]  # declared output -> metric key ("" : the collected tensor)
    collect: tuple[str, ...]  # runtime values to collect for outputs without a metric
    values: dict[str, str]  # logic name -> kind

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(op.role for op in self.dataflow if op.role != DRIVER_ROLE))


def compile_step(
    logic: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    roles: Sequence[str] | Mapping[str, Any],
) -> CompiledStep:
    """Compile `logic` for a builder that declared runtime `roles` (actor, rollout,
    reference, critic, reward). Raises CompileError (a ConfigError) naming the line."""
    front = _Front(logic)
    stmts = front.parse()
    return _Compiler(front, stmts, tuple(inputs), tuple(outputs), set(roles)).run()


class _Compiler:
    def __init__(
        self,
        front: _Front,
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
        return _Lowering(self).run()

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
                    "works on prompts' scores, log-probs, values and advantages",
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


# ---------------------------------------------------------------------------------------
# Back end: typed values -> ops. The shapes below are the bundled presets' (grpo/ppo):
# the sampler's log-probs stand for the actor's (hybrid engine: same weights), GRPO's KL
# is an actor loss term, PPO's KL a penalty inside the `advantages` driver op.

SEQ = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")
_ADV_ALGOS = {"gae": "gae", "grpo": "grpo", "rloo": "rloo", "reinforce_pp": "reinforce_pp"}
_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
_ADV_PARAMS = {  # the params the `advantages` op gets per estimator, with defaults
    "gae": {"gamma": 1.0, "lam": 0.95, "whiten": True},
    "grpo": {"norm_std": True},
    "rloo": {},
    "reinforce_pp": {"gamma": 1.0},
    "reinforce_pp_baseline": {"gamma": 1.0},
}
PPO_KL = {"kl_coef": 0.05, "kl_target": 0.1, "kl_horizon": 10000}  # penalty in the reward
GRPO_KL_COEF = 0.05  # KL as an actor loss term
DEFAULT_GROUP_SIZE = 8  # samples per prompt for group estimators when generate says no n
_ROLLOUT_OPTIONS = ("temperature", "top_p", "top_k", "max_new_tokens")
_ACTOR_LOSS_OPTIONS = {
    "clip_ratio": "clip_ratio_low",
    "clip_ratio_low": "clip_ratio_low",
    "clip_ratio_high": "clip_ratio_high",
    "dual_clip_c": "dual_clip_c",
    "entropy_coef": "entropy_coef",
}
ARITH_OP = "hybridflow.pipeline.expr:arith"
SCORE_ADV_OP = "hybridflow.pipeline.expr:ScoreAdvantages"


class _Lowering:
    def __init__(self, comp: _Compiler) -> None:
        self.c = comp
        self.role_options: dict[str, dict[str, Any]] = {}
        self.data_options: dict[str, Any] = {}
        self.arith: dict[str, OpConfig] = {}  # arith ops by output name (emitted once)

    def opt(self, role: str, **kv: Any) -> None:
        self.role_options.setdefault(role, {}).update(kv)

    def run(self) -> CompiledStep:
        c = self.c
        gen = c.calls.get(("rollout", "generate"))
        if gen is None:
            raise CompileError(
                0, "the logic never generates: start with `response = actor.generate(prompt)`"
            )
        gen_opts = dict(gen.kwargs)
        for key in _ROLLOUT_OPTIONS:
            if key in gen_opts:
                self.opt("rollout", **{key: gen_opts[key]})
        # Truncated sampling (top-k/top-p) changes the sampler's log-probs: then the
        # actor's own log-probs are computed by an actor.get_logprob op.
        truncated = gen_opts.get("top_k") not in (None, 0) or gen_opts.get("top_p") not in (
            None,
            1,
            1.0,
        )
        self.old_key = "old_logprobs" if truncated else "rollout_logprobs"
        loss = self._policy_loss()
        group = loss is not None and loss["estimator"] in GROUP_ESTIMATORS
        n = gen_opts.get("n")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise self.c.err(gen, f"n= must be an int >= 1 (samples per prompt), got {n!r}")
        if group:
            n = DEFAULT_GROUP_SIZE if n is None else n
            if n < 2:
                raise self.c.err(
                    gen, f"{loss['fn']} compares the samples of a prompt: n= must be >= 2"
                )
        self.data_options["samples_per_prompt"] = n or 1

        ops: list[OpConfig] = [
            OpConfig(
                "rollout",
                "generate",
                ("prompt_ids", "prompt_mask"),
                ("response_ids", "response_mask", "rollout_logprobs"),
                phase="rollout",
            )
        ]
        fields = ["prompt_ids", "prompt_mask", "metadata_json"] + (["group_index"] if group else [])
        need = self._needed(loss)
        if "reward" in need:
            ops.append(
                OpConfig(
                    "reward",
                    "score",
                    (*SEQ, "metadata_json", *(("group_index",) if group else ())),
                    ("rewards",),
                    phase="reward",
                )
            )
        if "reference" in need:
            ops.append(OpConfig("reference", "get_logprob", SEQ, ("ref_logprobs",), phase="ref"))
        if "actor_logprob" in need and truncated:
            ops.append(OpConfig("actor", "get_logprob", SEQ, ("old_logprobs",), phase="logprob"))
        if "critic" in need:
            ops.append(OpConfig("critic", "values", SEQ, ("values",), phase="values"))
        for sym in c.env.values():  # arithmetic the step reports or a loss reads
            if "expr" in sym.info and (sym.name in c.outputs or sym.info.get("feeds_loss")):
                ops.append(self._arith_op(sym))
        if loss is not None:
            ops += self._training_ops(loss, group)
        outputs, collect = self._outputs()
        return CompiledStep(
            dataflow=tuple(ops),
            data_fields=tuple(fields),
            role_options={**self.role_options, "data": self.data_options},
            outputs=outputs,
            collect=collect,
            values={name: s.kind for name, s in c.env.items()},
        )

    # -- the policy loss, resolved --------------------------------------------------------
    def _policy_loss(self) -> dict[str, Any] | None:
        c = self.c
        sym = c.updates.get("actor")
        if sym is None:
            if "critic" in c.updates:
                raise CompileError(
                    c.calls[("critic", "update")].line,
                    "critic.update without actor.update: the critic only serves the policy",
                )
            return None
        sym = _unalias(sym)
        fn, args, opts = sym.info["fn"], sym.info["args"], dict(sym.info["opts"])
        line = sym.line
        first = _unalias(args[0])
        kl = _unalias(args[1]) if len(args) > 1 else None
        out: dict[str, Any] = {"fn": fn, "line": line, "kl": None, "kl_mode": None}
        values: Sym | None = None
        if first.kind == "advantages":
            adv = first
            estimator = _ADV_ALGOS[adv.info["fn"]]
            adv_opts = dict(adv.info["opts"])
            score = _unalias(adv.info["args"][0])
            if estimator == "gae":
                values = _unalias(adv.info["args"][1])
            if "estimator" in opts:
                raise c.err(line, "estimator= conflicts with advantages computed on their own line")
        else:
            score = first
            adv_opts = {k: opts.pop(k) for k in ("gamma", "lam", "whiten", "norm_std") if k in opts}
            default = (
                "grpo" if fn == "grpo_loss" else ("gae" if "critic" in c.roles else "reinforce_pp")
            )
            estimator = str(opts.pop("estimator", default))
            if estimator not in _ESTIMATORS:
                raise c.err(
                    line, f"estimator= must be one of {', '.join(_ESTIMATORS)}, got {estimator!r}"
                )
        if estimator == "gae" and values is None:
            if "critic" not in c.roles:
                raise c.err(
                    line,
                    "GAE needs a critic (df.add_critic); or use estimator='grpo'/'rloo'/'reinforce_pp'",
                )
            values = next((s for s in c.env.values() if s.kind == "values"), None)
            out["implicit_values"] = values is None
        unknown = [k for k in adv_opts if k not in _ADV_PARAMS[estimator]]
        if unknown:
            raise c.err(line, f"option {unknown[0]}= does not apply to the {estimator} estimator")
        out["adv_params"] = {"estimator": estimator, **_ADV_PARAMS[estimator], **adv_opts}
        out["estimator"] = estimator
        out["values"] = values
        # The score: the reward model's `rewards`, maybe penalised by KL, maybe derived.
        if score.info.get("fn") == "kl_penalty":
            base, pkl = (_unalias(a) for a in score.info["args"])
            if kl is not None:
                raise c.err(line, "the score already carries a KL penalty; pass no KL to the loss")
            coef = score.info["opts"].get("coef", PPO_KL["kl_coef"])
            out["penalty"] = {"kl": pkl, "kl_coef": float(coef), "kl_target": None}
            score = base
        elif kl is not None and fn == "ppo_loss":
            out["penalty"] = {
                "kl": kl,
                "kl_coef": float(opts.pop("kl_coef", PPO_KL["kl_coef"])),
                "kl_target": PPO_KL["kl_target"] if "kl_coef" not in sym.info["opts"] else None,
            }
        elif kl is not None:  # grpo_loss: KL as a loss term of the actor
            out["loss_kl"] = {"kl": kl, "coef": float(opts.pop("kl_coef", GRPO_KL_COEF))}
        if "expr" in score.info:
            score.info["feeds_loss"] = True
            out["score_key"] = score.name
        elif score.kind != "score" or score.info.get("fn") is not None:
            raise c.err(line, f"{score.name} is not a reward score a loss can use")
        out["score"] = score
        for key in ("kl_coef", "kl_type"):
            opts.pop(key, None)
        for key, value in opts.items():
            if key in _ACTOR_LOSS_OPTIONS:
                self.opt("actor", **{_ACTOR_LOSS_OPTIONS[key]: value})
        crit = c.updates.get("critic")
        if crit is not None:
            crit = _unalias(crit)
            if estimator != "gae":
                raise c.err(
                    c.calls[("critic", "update")].line,
                    f"critic.update learns from GAE returns, but the policy loss uses the "
                    f"{estimator} estimator; use gae(...) advantages or drop critic.update",
                )
            if crit.kind == "value_loss":
                cv = crit.info["opts"].get("cliprange_value")
                if "cliprange_value" in crit.info["opts"]:
                    self.opt("critic", cliprange_value=cv)
        out["critic_update"] = estimator == "gae"  # a critic that feeds GAE learns from it
        return out

    def _needed(self, loss: dict[str, Any] | None) -> set[str]:
        c = self.c
        need = {role for (role, op) in c.calls if op != "update"}
        if ("actor", "get_logprob") in c.calls:
            need.add("actor_logprob")
        need.discard("actor")
        if loss is not None:
            need.add("reward")
            if loss.get("values") is not None or loss.get("implicit_values"):
                need.add("critic")
            for key in ("penalty", "loss_kl"):
                if key in loss:
                    need |= {"reference", "actor_logprob"}
        for sym in c.env.values():
            if "expr" in sym.info and (sym.name in c.outputs or sym.info.get("feeds_loss")):
                for a in sym.info["args"]:
                    k = _unalias(a).kind
                    if k == "ref_logprob":
                        need.add("reference")
                    if k == "actor_logprob":
                        need.add("actor_logprob")
        return need

    def _kl_kind(self, kl: Sym) -> str:
        return str(kl.info.get("estimator", "k1"))

    def _training_ops(self, loss: dict[str, Any], group: bool) -> list[OpConfig]:
        c = self.c
        has_ref = "reference" in c.roles and (
            ("reference", "get_logprob") in c.calls or "penalty" in loss or "loss_kl" in loss
        )
        critic = loss["critic_update"]
        params = dict(loss["adv_params"])
        score_key = loss.get("score_key", "rewards")
        inputs = [score_key, "response_mask"]
        if group:
            inputs.append("group_index")
        inputs.append("prompt_mask")
        if critic:
            inputs.append("values")
        if "penalty" in loss:
            pen = loss["penalty"]
            inputs += [self.old_key, "ref_logprobs"]
            params["kl_penalty"] = self._kl_kind(pen["kl"])
            params["kl_coef"] = pen["kl_coef"]
            if pen["kl_target"] is not None:
                params["kl_target"] = pen["kl_target"]
                params["kl_horizon"] = PPO_KL["kl_horizon"]
            if self.old_key != "rollout_logprobs":
                params["old_logprob_key"] = self.old_key
        if score_key != "rewards":
            params["score"] = score_key
        outs = ("advantages", "returns") if critic else ("advantages",)
        ops = [
            OpConfig(
                DRIVER_ROLE,
                "advantages" if score_key == "rewards" else SCORE_ADV_OP,
                tuple(inputs),
                outs,
                phase="adv",
                params=params,
            )
        ]
        actor_in = [*SEQ, "advantages", self.old_key] + (["ref_logprobs"] if has_ref else [])
        ops.append(OpConfig("actor", "update", tuple(actor_in), phase="train"))
        self.opt("actor", old_logprob_key=self.old_key)
        if "loss_kl" in loss:
            lk = loss["loss_kl"]
            self.opt("actor", kl_loss_coef=lk["coef"], kl_loss_type=self._kl_kind(lk["kl"]))
        else:
            self.opt("actor", kl_loss_coef=0.0)
        if critic:
            ops.append(OpConfig("critic", "update", (*SEQ, "returns", "values"), phase="train"))
        ops.append(OpConfig("actor", "optimizer_step", scope="step", phase="train"))
        if critic:
            ops.append(OpConfig("critic", "optimizer_step", scope="step", phase="train"))
        ops.append(OpConfig("actor", "reshard", scope="step", phase="reshard"))
        return ops

    def _arith_op(self, sym: Sym) -> OpConfig:
        runtime = {
            n: _runtime_name(self.c.env[n], self.old_key)
            for n in expr_ops.names_in(sym.info["expr"])
        }
        for name in (sym.name,):
            taken = (
                {f for k in KINDS.values() for f in k.fields}
                | set(SEQ)
                | {"rollout_logprobs", "returns", "group_index", "metadata_json"}
            )
            if name in taken:
                raise self.c.err(
                    sym.line, f"{name!r} is a name the runtime uses; pick another value name"
                )
        node = _Rename(runtime).visit(ast.parse(ast.unparse(sym.info["expr"]), mode="eval").body)
        inputs = list(dict.fromkeys(runtime.values()))
        if sym.info.get("per_token"):
            inputs.append("response_mask")
        return OpConfig(
            DRIVER_ROLE,
            ARITH_OP,
            tuple(inputs),
            (sym.name,),
            phase="expr",
            params={"expr": ast.unparse(node), "output": sym.name},
        )

    def _outputs(self) -> tuple[dict[str, str], tuple[str, ...]]:
        c = self.c
        metrics: dict[str, str] = {}
        collect: list[str] = []
        for name in c.outputs:
            sym = c.env.get(name)
            if sym is None:  # a runtime name (`rewards`): report the value that carries it
                sym = next(s for s in c.env.values() if name in KINDS[s.kind].fields)
            sym = _unalias(sym)
            metric = KINDS[sym.kind].metric
            if "expr" in sym.info:
                metric = ""
            metrics[name] = metric
            if not metric:
                collect.append(_runtime_name(sym, self.old_key))
        return metrics, tuple(dict.fromkeys(collect))


class _Rename(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(id=self.names.get(node.id, node.id), ctx=node.ctx)


def _unalias(sym: Sym) -> Sym:
    while "alias_of" in sym.info:
        sym = sym.info["alias_of"]
    return sym


def _runtime_name(sym: Sym, old_key: str) -> str:
    sym = _unalias(sym)
    if "expr" in sym.info or sym.kind == "tensor":
        return sym.name
    if sym.kind == "actor_logprob":
        return old_key
    fields = KINDS[sym.kind].fields
    if not fields:
        raise CompileError(
            sym.line, f"{sym.name} ({sym.kind}) is not a tensor the dataflow carries"
        )
    return fields[0]

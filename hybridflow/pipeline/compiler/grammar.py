"""The step-logic language: its tables and its parser (syntax only; nothing is run).

Tables (the ONE place that names things):
  KINDS         logic value kinds -> the runtime tensors they stand for (`score` is
                `rewards`, `response` is response_ids/response_mask, ...)
  ROLES         logic role names -> topology roles (`ref` is `reference`), from
                hybridflow.config.stages' ROLE_NAMES
  ROLE_METHODS  role.method(...) calls: accepted argument kinds, result kind, options
  ALGORITHMS    algorithm functions: accepted argument kinds, result kind, options
                (named after the actor / `advantages` op option each sets; older
                spellings kept as aliases)
                (the advantage estimators among them come from hybridflow.algos'
                ADVANTAGE_ESTIMATORS: one function per estimator, its options)
Parser: `parse_logic(text)` -> `Stmt`s, one per line, or a CompileError naming the line
and the reason (imports, loops, attributes of other objects, lambdas, subscripts, dunder
names, unknown functions, ... are refused here). The typed values the frontend makes of
the statements are in ir.py.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridflow.algos.advantages import ADVANTAGE_ESTIMATORS
from hybridflow.config.fields import METADATA, PROMPT_FIELDS, RESPONSE_FIELDS
from hybridflow.config.stages import ROLE_NAMES
from hybridflow.errors import CompileError
from hybridflow.pipeline.compiler.ir import Scalar
from hybridflow.pipeline.driver import expr as expr_ops

# ---------------------------------------------------------------------------------------
# THE name table: what a logic value stands for on the wire.


@dataclass(frozen=True)
class Kind:
    fields: tuple[str, ...]  # runtime tensors the value stands for
    metric: str  # the per-step metric that reports it when declared an output
    doc: str


KINDS: dict[str, Kind] = {
    "prompt": Kind(PROMPT_FIELDS, "", "prompts from the data source"),
    "response": Kind(RESPONSE_FIELDS, "response_length/mean", "sampled responses"),
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
DATA_FIELDS = (*PROMPT_FIELDS, METADATA)

# Logic role names -> runtime role names (topology roles): every name of config's role
# table but the rollout's (the logic reaches the sampler through actor.generate).
ROLES: dict[str, str] = {
    name: kind for kind, names in ROLE_NAMES.items() if kind != "rollout" for name in names
}


def logic_name(runtime_role: str) -> str:
    """The name the logic and its messages use for a runtime role (`reference` -> `ref`)."""
    return ROLE_NAMES[runtime_role][0] if runtime_role in ROLE_NAMES else runtime_role


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
    # Older spellings still accepted: alias -> the option it means (documented in the
    # step-logic reference; giving both is an error).
    aliases: Mapping[str, str] = field(default_factory=dict)

    def option(self, name: str) -> str:
        """The option a keyword means (an alias resolved); "" for none."""
        name = self.aliases.get(name, name)
        return name if name in self.options else ""


# Loss options are named after the option they set, so the logic, the YAML and the
# reference speak one vocabulary: the actor's options of the same names ...
ACTOR_LOSS_OPTIONS = (
    "clip_ratio_low",
    "clip_ratio_high",
    "dual_clip_c",
    "entropy_coef",
    "policy_loss",  # ppo | gspo | cispo: hybridflow.algos.POLICY_LOSSES
    "loss_agg_mode",  # seq-mean-token-sum-norm also needs loss_norm_len
    "loss_norm_len",
)
# ... and the KL's: ppo_loss's KL is a penalty in the reward (the `advantages` op's
# kl_coef and kl_penalty), grpo_loss's a term of the actor loss (the actor's kl_loss_coef
# and kl_loss_type). A KL option must agree with the KL argument it applies to.
PPO_KL_OPTIONS = ("kl_coef", "kl_penalty")
GRPO_KL_OPTIONS = ("kl_loss_coef", "kl_loss_type")
# The spellings before the options took those names.
_LOSS_ALIASES = {"clip_ratio": "clip_ratio_low"}
PPO_ALIASES = {**_LOSS_ALIASES, "kl_type": "kl_penalty"}
GRPO_ALIASES = {**_LOSS_ALIASES, "kl_coef": "kl_loss_coef", "kl_type": "kl_loss_type"}
# DAPO's reward shaping and dynamic sampling's filter: params of the `advantages` op.
SHAPING_OPTIONS = (
    "dynamic_sampling",
    "overlong_buffer_len",
    "overlong_max_len",
    "overlong_penalty_factor",
)
# Every option of any advantage estimator, in table order (a loss that estimates its own
# advantages takes them).
ESTIMATOR_OPTIONS: tuple[str, ...] = tuple(
    dict.fromkeys(o for spec in ADVANTAGE_ESTIMATORS.values() for o in spec.options)
)
ALGORITHMS: dict[str, Algorithm] = {
    "ppo_loss": Algorithm(
        (("score",), ("score", "kl"), ("advantages",), ("advantages", "kl")),
        "policy_loss",
        (*ACTOR_LOSS_OPTIONS, *PPO_KL_OPTIONS, *SHAPING_OPTIONS, "estimator", *ESTIMATOR_OPTIONS),
        "PPO clip loss; from a score it estimates advantages (GAE with a critic, else "
        "`estimator`); a KL argument becomes a penalty in the reward",
        PPO_ALIASES,
    ),
    "grpo_loss": Algorithm(
        (("score",), ("score", "kl")),
        "policy_loss",
        (
            *ACTOR_LOSS_OPTIONS,
            *GRPO_KL_OPTIONS,
            *SHAPING_OPTIONS,
            *ADVANTAGE_ESTIMATORS["grpo"].options,
            "estimator",
        ),
        "PPO clip loss on group-normalised advantages; a KL argument becomes a loss term",
        GRPO_ALIASES,
    ),
    # One function per advantage estimator: `advantages = gae(score, values)`, `grpo(score)`.
    **{
        name: Algorithm(
            (("score", "values"),) if spec.needs_values else (("score",),),
            "advantages",
            spec.options,
            spec.doc,
        )
        for name, spec in ADVANTAGE_ESTIMATORS.items()
    },
    "kl": Algorithm((("actor_logprob", "ref_logprob"),), "kl", ("kind",), "per-token KL estimate"),
    "kl_penalty": Algorithm(
        (("score", "kl"),),
        "score",
        ("kl_coef",),
        "the reward minus kl_coef * KL (PPO penalty)",
        {"coef": "kl_coef"},
    ),
    "value_loss": Algorithm(
        (("values", "advantages"), ("advantages",)),
        "value_loss",
        ("cliprange_value",),
        "clipped value loss on the returns",
    ),
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


class LogicParser:
    def __init__(self, text: str) -> None:
        self.text = textwrap.dedent(text).strip("\n")
        self.lines = self.text.splitlines()

    def error(self, node: ast.AST | int, message: str) -> CompileError:
        line = node if isinstance(node, int) else getattr(node, "lineno", 0)
        source = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        if len(source) > 120:  # a 100 KB line is quoted by its start
            source = source[:117] + "..."
        return CompileError(line, message, source)

    def parse(self) -> list[Stmt]:
        try:
            tree = ast.parse(self.text, mode="exec")
        except SyntaxError as exc:
            raise self.error(exc.lineno or 0, f"not valid Python syntax: {exc.msg}") from None
        except (RecursionError, MemoryError):
            # CPython's parser gives up on deep nesting without a line: find it.
            raise self.error(self._too_deep_line(), _TOO_DEEP) from None
        for node in tree.body:  # before any recursive walk of the tree (here or later)
            if expr_ops.depth(node, _MAX_DEPTH) > _MAX_DEPTH:
                raise self.error(node, _TOO_DEEP)
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

    def _too_deep_line(self) -> int:
        """The first line that alone is too deep for the parser (0: none alone is)."""
        for i, line in enumerate(self.lines, start=1):
            try:
                ast.parse(line.strip(), mode="exec")
            except (RecursionError, MemoryError):
                return i
            except SyntaxError:
                continue  # a part of a multi-line statement
        return 0

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
                    "or as keyword options (e.g. ppo_loss(score, kl, kl_coef=0.05))",
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
                    f"are {', '.join(sorted({logic_name(r) for r in ROLES.values()}))}",
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


# A statement's expression tree may nest this deep (the statement itself included).
_MAX_DEPTH = expr_ops.MAX_DEPTH + 4
_TOO_DEEP = (
    f"nested too deeply (at most {expr_ops.MAX_DEPTH} levels of operators or parentheses); "
    "split the expression over several lines"
)


def parse_logic(text: str) -> tuple[LogicParser, list[Stmt]]:
    """-> (the parser, holding the source lines for error messages; the statements)."""
    front = LogicParser(text)
    return front, front.parse()

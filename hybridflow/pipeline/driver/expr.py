"""Arithmetic between named values, as a driver op (`role: driver`, computed in the
coordinator): what the step-logic compiler emits for a line such as
`bonus = 2.0 * reward_score - penalty`.

The expression travels as a string param (`expr`), in a tiny grammar of its own:
value names, numbers, `+ - * /` and unary minus, parentheses. It is parsed with `ast`
and evaluated by walking that tree; nothing is ever `eval`'d, and any other node is
refused (the compiler checked the same grammar at build time, so a refusal here means
a hand-written topology).

    arith(batch, {"expr": "a - 0.1 * b", "output": "c"})  ->  ({"c": tensor}, {})

Shapes: operands are per-sample [B] or per-token [B, R]; a [B] operand meets a [B, R]
one as [B, 1] (broadcast over the response). When the result is per-token and the
batch carries `response_mask` [B, R], padding positions are set to 0, so padding never
leaks into a later statistic.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from hybridflow.errors import BatchError, ConfigError
from hybridflow.pipeline.driver.registry import reads_params

Batch = dict[str, torch.Tensor]

BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


# Deepest expression tree accepted (a + b + ... nests one level per operator). Every
# walk below is recursive: the bound keeps them far from Python's recursion limit.
MAX_DEPTH = 64


def depth(node: ast.AST, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of `node`, counted without recursion; stops counting past `limit`."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        current, level = stack.pop()
        deepest = max(deepest, level)
        if deepest > limit:
            break
        stack.extend((child, level + 1) for child in ast.iter_child_nodes(current))
    return deepest


def check_expr(node: ast.AST) -> str | None:
    """None if `node` is in the grammar, else the reason it is not."""
    if isinstance(node, ast.Name):
        return "dunder names are not allowed" if node.id.startswith("__") else None
    if isinstance(node, ast.Constant):
        ok = isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
        return None if ok else f"only numbers may appear in arithmetic, not {node.value!r}"
    if isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.USub, ast.UAdd)):
            return "only unary minus/plus is allowed in arithmetic"
        return check_expr(node.operand)
    if isinstance(node, ast.BinOp):
        if type(node.op) not in BINOPS:
            return "only + - * / are allowed in arithmetic"
        return check_expr(node.left) or check_expr(node.right)
    return f"{type(node).__name__} is not allowed in arithmetic"


def names_in(node: ast.AST) -> list[str]:
    """Value names an expression reads, in first-use order."""
    out: list[str] = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id not in out:
            out.append(sub.id)
    return out


def unparse(node: ast.AST) -> str:
    return ast.unparse(node)


def _evaluate(node: ast.AST, values: Batch) -> Any:
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.Constant):
        return float(cast(float, node.value))  # check_expr admits numbers only
    if isinstance(node, ast.UnaryOp):
        v = _evaluate(node.operand, values)
        return -v if isinstance(node.op, ast.USub) else v
    assert isinstance(node, ast.BinOp)
    left, right = _evaluate(node.left, values), _evaluate(node.right, values)
    if isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor):
        left, right = _align(left, right)
    return BINOPS[type(node.op)](left, right)


def _align(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] against [B, R]: the [B] side becomes [B, 1]."""
    if a.dim() == 1 and b.dim() == 2:
        return a[:, None], b
    if a.dim() == 2 and b.dim() == 1:
        return a, b[:, None]
    return a, b


def _parse(params: Mapping[str, Any]) -> tuple[ast.AST, str]:
    """(the expression's tree, the output name); ValueError naming the param at fault."""
    text, output = params.get("expr"), params.get("output")
    if not isinstance(output, str):
        raise ValueError("output", "must be the output value's name (a string)")
    if not isinstance(text, str):
        raise ValueError("expr", "must be an arithmetic expression (a string)")
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError as exc:
        raise ValueError("expr", f"{text!r} is not an expression: {exc.msg}") from exc
    except (RecursionError, MemoryError):
        raise ValueError("expr", f"expression nested too deeply (at most {MAX_DEPTH})") from None
    if depth(node) > MAX_DEPTH:
        raise ValueError("expr", f"expression nested too deeply (at most {MAX_DEPTH})")
    reason = check_expr(node)
    if reason:
        raise ValueError("expr", f"{text!r}: {reason}")
    return node, output


def _check_params(params: Mapping[str, Any], path: str) -> None:
    """Plan time: the same checks the op makes on its params, as ConfigErrors."""
    try:
        _parse(params)
    except ValueError as exc:
        key, message = exc.args
        raise ConfigError(f"{path}.{key}", message) from None


@reads_params("expr", "output", check=_check_params)
def arith(batch: Batch, params: dict[str, Any]) -> tuple[Batch, dict[str, float]]:
    """The driver op (see the module docstring)."""
    try:
        node, output = _parse(params)
    except ValueError as exc:
        key, message = exc.args
        raise BatchError(f"arith: params.{key}: {message}") from None
    text = params["expr"]
    missing = [n for n in names_in(node) if n not in batch]
    if missing:
        raise BatchError(f"arith: {text!r} needs {missing}; the batch has {sorted(batch)}")
    values = {k: v.float() if v.dtype.is_floating_point else v for k, v in batch.items()}
    result = _evaluate(node, values)
    if not isinstance(result, torch.Tensor):
        raise BatchError(f"arith: {text!r} reads no value (a constant is not a batch value)")
    mask = batch.get("response_mask")
    if result.dim() == 2 and mask is not None and mask.shape == result.shape:
        result = result * mask.to(result.dtype)
    return {output: result.float()}, {}


class ScoreAdvantages:
    """The `advantages` driver op (pipeline/driver/rl_ops.py) reading its score from another
    value than the reward role's `rewards`: what a logic line such as
    `loss = ppo_loss(2.0 * reward_score)` compiles to (the score is an arith output).

    Params: those of `advantages` plus `score` (the value holding the scores [B])."""

    def __init__(self, topology: Any, index: int) -> None:
        from dataclasses import replace

        from hybridflow.errors import ConfigError
        from hybridflow.pipeline.driver.rl_ops import Advantages

        cfg = topology.dataflow[index]
        params = dict(cfg.params)
        key = params.pop("score", None)
        if not isinstance(key, str) or key not in cfg.inputs or "rewards" in cfg.inputs:
            raise ConfigError(
                f"dataflow[{index}].params.score",
                "must name one of the op's inputs (the scores), and `rewards` must not be one",
            )
        inputs = tuple("rewards" if n == key else n for n in cfg.inputs)
        ops = list(topology.dataflow)
        ops[index] = replace(cfg, inputs=inputs, params=params)
        self.key = key
        self.inner = Advantages(replace(topology, dataflow=tuple(ops)), index)

    def __call__(self, batch: Batch, params: dict[str, Any]) -> tuple[Batch, dict[str, float]]:
        renamed = dict(batch)
        renamed["rewards"] = renamed.pop(self.key)
        return self.inner(renamed, params)

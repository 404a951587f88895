"""Countdown (TinyZero, verl): reach the target from the given numbers, each used once.

    compute_score(data_source, solution_str, ground_truth, extra_info=None,
                  *, format_score=0.1, score=1.0) -> Score

  ground_truth  {"target": 24, "numbers": [3, 4, 5, 6]}: a mapping or its JSON text
                (any sequence of integers for `numbers`, e.g. a numpy array from parquet)
  answer        the equation in the response's last `<answer>...</answer>`
  reward        `score` if it uses exactly the given numbers (as a multiset) and equals
                the target; `format_score` if it is plain arithmetic but wrong (wrong
                value, a number missing, reused or not given, a division by zero); 0.0
                if there is no answer or it is not plain arithmetic.
  pred          the equation without spaces when it is plain arithmetic, else ""

Invariant: the equation is never executed. It is parsed with `ast` and evaluated by a
walker that knows integer literals, + - * /, unary minus and parentheses, in exact
fractions (so `(6/4)*4 == 6` holds where floats would need a tolerance); any other node
(a name, a call, an attribute, `**`) makes it "not arithmetic". It is length-capped
before parsing, so neither the parser nor the arithmetic can be made to run long.
"""

from __future__ import annotations

import ast
import json
import numbers
from collections import Counter
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from hybridflow.reward.scorers._common import Score, check_text, number_option, result

# Countdown equations combine a handful of two-digit numbers; 200 characters is far
# beyond any real one and keeps ast (whose nesting limit is ~200 parentheses) and the
# big-integer arithmetic cheap.
_MAX_EQUATION_CHARS = 200

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,  # Fraction / Fraction(0) raises ZeroDivisionError
}
_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.USub, ast.UAdd, *_BINARY)


def _is_arithmetic(tree: ast.AST) -> bool:
    return all(
        isinstance(n, _ALLOWED) or (isinstance(n, ast.Constant) and type(n.value) is int)
        for n in ast.walk(tree)
    )  # `type(...) is int`: not bool, not float, not str


def _value(node: ast.AST) -> Fraction:
    # Only called on a tree `_is_arithmetic` accepted.
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        operand = _value(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    assert isinstance(node, ast.BinOp)
    return _BINARY[type(node.op)](_value(node.left), _value(node.right))


def evaluate(equation: str) -> tuple[Fraction | None, list[int]] | None:
    """(value, integers used) of plain arithmetic; value None on a division by zero.

    None when `equation` is not plain arithmetic (or longer than the cap).
    """
    if len(equation) > _MAX_EQUATION_CHARS:
        return None
    try:
        tree = ast.parse(equation.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not _is_arithmetic(tree):
        return None
    used = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
    try:
        return _value(tree.body), used
    except ZeroDivisionError:
        return None, used


def last_answer(text: str) -> str | None:
    """The content of the last `<answer>...</answer>`; None if there is none.

    Found with rfind, not a lazy `.*?` regex, whose scan from every unclosed `<answer>`
    to the end of the text is quadratic on a degenerate rollout.
    """
    end = text.rfind("</answer>")
    if end < 0:
        return None
    start = text.rfind("<answer>", 0, end)
    return None if start < 0 else text[start + len("<answer>") : end]


def parse_ground_truth(ground_truth: Any) -> tuple[int, list[int]]:
    """(target, numbers) from {"target": int, "numbers": [int, ...]} or its JSON text."""
    gt = ground_truth
    if isinstance(gt, str | bytes):
        try:
            gt = json.loads(gt)
        except ValueError as exc:
            raise ValueError(f"countdown: ground_truth is not JSON: {ground_truth!r}") from exc
    if not isinstance(gt, Mapping) or "target" not in gt or "numbers" not in gt:
        raise ValueError(
            f"countdown: ground_truth must be {{'target': int, 'numbers': [int, ...]}}, "
            f"got {ground_truth!r}"
        )
    target, given = gt["target"], gt["numbers"]
    if isinstance(given, str | bytes | Mapping) or not hasattr(given, "__iter__"):
        raise ValueError(f"countdown: ground_truth numbers must be a sequence, got {given!r}")
    values = [target, *given]
    # numbers.Integral: numpy's integers too (a parquet-loaded row), never bool.
    if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in values):
        raise ValueError(f"countdown: target and numbers must be integers, got {ground_truth!r}")
    return int(target), [int(v) for v in given]


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    format_score: float = 0.1,
    score: float = 1.0,
) -> Score:
    """Reward one countdown response; see the module docstring."""
    check_text("countdown: solution_str", solution_str)
    format_score = number_option(extra_info, "format_score", format_score)
    score = number_option(extra_info, "score", score)
    target, given = parse_ground_truth(ground_truth)
    equation = last_answer(solution_str)
    evaluated = None if equation is None else evaluate(equation)
    if evaluated is None:
        return result(0.0, False, "")
    value, used = evaluated
    pred = "".join(equation.split())
    correct = Counter(used) == Counter(given) and value == target
    return result(score if correct else format_score, correct, pred)

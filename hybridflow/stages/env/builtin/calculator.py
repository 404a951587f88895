"""The calculator tool, and the environment that lets a model use it on word problems.

    calc("(7 + 5) * 3 - 4 / 8")   -> "35.5"
    calc("__import__('os')")      -> ValueError (shown to the model as a tool error)

    env: calculator              # hybridflow.stages.env.builtin.calculator:CalculatorEnv
    env_options: {max_turns: 4}

`calc` evaluates arithmetic only: numbers, + - * /, parentheses and unary minus/plus. The
expression is parsed with `ast` and walked by a tiny evaluator that knows exactly those
node types; nothing is ever `eval`'d, no name, call, attribute, subscript or power can be
expressed. Arithmetic is exact (`fractions.Fraction`), so 0.1 + 0.2 is 0.3 and 7 / 2 is
3.5; a result is shown as an integer when it is one, else as a decimal of at most 6
places. Bounds keep every call cheap whatever the model writes: at most MAX_CHARS
characters (so at most ~MAX_CHARS/2 levels of nesting: the recursion stays shallow), and
every literal and intermediate value within MAX_ABS (so no product can grow huge).

`CalculatorEnv` is a ToolEnv with `calc` as its tool and the gsm8k verifier
(hybridflow.reward.scorers.gsm8k, strict `#### N`) as its final reward, for the word
problems of hybridflow.data.word_problems.
"""

from __future__ import annotations

import ast
import math
import warnings
from fractions import Fraction
from typing import Any

from hybridflow.stages.env.tool_env import ToolEnv

__all__ = ["MAX_ABS", "MAX_CHARS", "MAX_DEPTH", "CalculatorEnv", "calc", "evaluate"]

MAX_CHARS = 200
MAX_DEPTH = 100  # MAX_CHARS already implies it (a level takes 2+ characters)
MAX_ABS = 10**15
_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; ValueError saying what is not allowed."""
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise ValueError(f"expression of {len(expression)} characters; at most {MAX_CHARS}")
    if not expression.strip():
        raise ValueError("empty expression")
    try:
        with warnings.catch_warnings():  # "12abc": a SyntaxWarning on stderr, then the error
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as exc:
        raise ValueError(f"not an arithmetic expression ({getattr(exc, 'msg', exc)})") from None
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None
    return _eval(tree.body, 0)


def _eval(node: ast.AST, depth: int) -> Fraction:
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Constant):
        value: Any = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"only numbers are allowed, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"a value beyond {MAX_ABS:.0e} in magnitude")
        # a float literal by its shortest repr: "0.1" is exactly 1/10, not 0.1's binary value
        return _bounded(Fraction(repr(value)) if isinstance(value, float) else Fraction(value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _eval(node.operand, depth + 1)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    what = (
        type(node.op).__name__ if isinstance(node, ast.BinOp | ast.UnaryOp) else type(node).__name__
    )
    raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {what}")


def _bounded(x: Fraction) -> Fraction:
    if abs(x) > MAX_ABS:
        raise ValueError(f"a value beyond {MAX_ABS:.0e} in magnitude")
    return x


def format_number(x: Fraction) -> str:
    if x.denominator == 1:
        return str(x.numerator)
    text = f"{float(x):.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Args:
        expression: Numbers combined with + - * / and parentheses, e.g. "(7 + 5) * 3".
    """
    return format_number(evaluate(expression))


class CalculatorEnv(ToolEnv):
    """ToolEnv(tools=[calc], reward=gsm8k); the options are ToolEnv's (explicit, so a
    misspelt `env_options` key is caught by name when the factory is built)."""

    def __init__(
        self,
        *,
        max_turns: int = 4,
        reward: Any = "gsm8k",
        parser: str = "hermes",
        max_calls_per_turn: int = 4,
        tool_timeout_s: float = 2.0,
        max_result_chars: int = 200,
        reward_timeout_s: float = 30.0,
        failure_score: float = 0.0,
        ground_truth_key: str = "reward_model.ground_truth",
    ) -> None:
        super().__init__(
            [calc],
            reward=reward,
            max_turns=max_turns,
            parser=parser,
            max_calls_per_turn=max_calls_per_turn,
            tool_timeout_s=tool_timeout_s,
            max_result_chars=max_result_chars,
            reward_timeout_s=reward_timeout_s,
            failure_score=failure_score,
            ground_truth_key=ground_truth_key,
        )

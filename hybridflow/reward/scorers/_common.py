"""What every scorer shares: the result shape, option lookup, number canonicalisation.

Invariants: `result` always returns exactly {score, acc, pred} with floats and a str;
`text_option` / `number_option` give a per-sample `extra_info` value precedence over
the keyword default and reject a wrong type by name (a bad option fails loudly, it never
scores silently).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, TypedDict


class Score(TypedDict):
    score: float  # the reward
    acc: float  # 1.0 correct, 0.0 otherwise
    pred: str  # the extracted, normalised answer ("" when none was found); maj@n votes on it


def result(score: float, correct: bool, pred: str) -> Score:
    return {"score": float(score), "acc": 1.0 if correct else 0.0, "pred": pred}


def check_text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def _lookup(extra_info: Any, name: str, default: Any) -> Any:
    # Per-sample beats per-run: a dataset row that sets `method` means that row.
    return extra_info.get(name, default) if isinstance(extra_info, Mapping) else default


def text_option(extra_info: Any, name: str, default: str) -> str:
    """`extra_info[name]` when the sample carries it, else the keyword default; a str."""
    value = _lookup(extra_info, name, default)
    if not isinstance(value, str):
        raise ValueError(f"option {name!r} must be a str, got {value!r}")
    return value


def number_option(extra_info: Any, name: str, default: float) -> float:
    """`extra_info[name]` when the sample carries it, else the keyword default; a float."""
    value = _lookup(extra_info, name, default)
    # Rewards are floats; a bool, a str or a NaN here is a config mistake, not a number.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"option {name!r} must be a finite number, got {value!r}")
    return float(value)


def canonical_number(text: str) -> str | None:
    """'1,234' -> '1234', '5.0' -> '5', '.50' -> '0.5', '-0' -> '0'; None if not a number.

    Thousands commas are dropped anywhere (GSM8K answers write them freely); a trailing
    '.' is a sentence end, not a decimal point.
    """
    s = text.strip().replace(",", "").rstrip(".")
    if not s or len(s) > 64:  # no real answer has more digits; keeps Decimal cheap
        return None
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    if not d.is_finite():  # Decimal accepts 'nan' / 'inf'; answers never are
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")

"""GSM8K: the final number of a response against the dataset's answer (verl's semantics).

    compute_score(data_source, solution_str, ground_truth, extra_info=None,
                  *, method="strict", format_score=0.0, score=1.0) -> Score

  strict     the LAST `#### N` in the response counts (it also tests the format the
             prompt asked for); `$` and thousands commas are dropped: "#### $1,234"
  flexible   the last number anywhere in the response counts

  reward     `score` if the answer equals the ground truth, `format_score` if an answer
             was found but is wrong, 0.0 if none was found (then pred is "")

Options come from `extra_info` (per sample) first, else the keyword arguments.

Beyond verl's reference (verl/utils/reward_score/gsm8k.py), deliberately: numbers are
compared canonically ("5.0" == "5", "1,234" == "1234", also in `pred`, so maj@n votes
count equal answers together), `#### $18` and `####18` are read, and `ground_truth` may
be a whole GSM8K solution ending in `#### N` (the dataset's raw `answer` field).

Invariant: only the last `_CLIP_CHARS` (+ the number cut at that edge) of a response
are searched, like verl, so cost per call is bounded whatever the response length.
"""

from __future__ import annotations

import re
from typing import Any

from hybridflow.reward.scorers._common import (
    Score,
    canonical_number,
    check_text,
    number_option,
    result,
    text_option,
)

METHODS = ("strict", "flexible")

# verl searches only the tail: the final answer sits at the end, and a degenerate
# rollout can be tens of thousands of characters of digits and commas, where a regex
# scan per sample (times thousands of samples per step) is real time on the reward
# path. The same window also keeps our rewards comparable with verl's: a `####` far
# from the end counts in neither.
_CLIP_CHARS = 300
# ... but a plain cut can split the answer itself ("#### 1234" -> "34"); widen the
# window leftwards over answer characters, at most this many.
_MAX_WIDEN = 32
_ANSWER_CHARS = frozenset("0123456789.,$#- ")

_NUMBER = r"-?[0-9.,]*[0-9][0-9.,]*"  # at least one digit: "." or "," alone is no answer
_STRICT = re.compile(r"####[ \t]*\$?[ \t]*(" + _NUMBER + ")")
_FLEXIBLE = re.compile(_NUMBER)


def _tail(text: str) -> str:
    if len(text) <= _CLIP_CHARS:
        return text
    start = len(text) - _CLIP_CHARS
    floor = start - _MAX_WIDEN
    while start > floor and text[start - 1] in _ANSWER_CHARS:
        start -= 1
    return text[start:]


def _normalise(number: str) -> str:
    canonical = canonical_number(number)
    return canonical if canonical is not None else number.replace(",", "").strip()


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer of a response, normalised (`_normalise`); None if there is none."""
    if method not in METHODS:
        raise ValueError(f"gsm8k: method must be one of {METHODS}, got {method!r}")
    tail = _tail(solution_str)
    found = _STRICT.findall(tail) if method == "strict" else _FLEXIBLE.findall(tail)
    return _normalise(found[-1]) if found else None


def ground_truth_answer(ground_truth: Any) -> str:
    """'72', 72, or a full solution '... #### 72' -> '72'."""
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, str | int | float):
        raise TypeError(f"gsm8k: ground_truth must be a str or number, got {ground_truth!r}")
    text = str(ground_truth)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return _normalise(text.strip().lstrip("$"))


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> Score:
    """Reward one GSM8K response; see the module docstring."""
    check_text("gsm8k: solution_str", solution_str)
    method = text_option(extra_info, "method", method)
    format_score = number_option(extra_info, "format_score", format_score)
    score = number_option(extra_info, "score", score)
    pred = extract_solution(solution_str, method)
    if pred is None:
        return result(0.0, False, "")
    correct = pred == ground_truth_answer(ground_truth)
    return result(score if correct else format_score, correct, pred)

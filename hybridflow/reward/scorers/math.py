"""MATH-style answers: the last `\\boxed{...}` of a response, checked for equivalence.

    compute_score(data_source, solution_str, ground_truth, extra_info=None,
                  *, format_score=0.0, score=1.0) -> Score

  answer     the content of the LAST `\\boxed{...}`, `\\boxed ...` (up to `$` or the line
             end) or `\\fbox{...}` in the response; braces nest. No box: reward 0.0,
             pred "". `ground_truth` is the bare answer, or a solution with a box in it.
  equal      math-verify (sympy) says the two are equal (`\\frac12` == `0.5`), or, when it
             says not, their string normalisations (`normalize_answer`) match
  reward     `score` if equal, `format_score` if a box was found but is wrong

Invariants:
  - math-verify is imported on the first call, never at import; without it a call
    raises ImportError naming the extra to install (`hybridflow[math]`).
  - math-verify runs with its timeouts off (`parsing_timeout=None`, `timeout_seconds=
    None`): its timeouts are `signal.alarm`, which only works on the main thread, and
    our callers run scorers in worker threads under their own per-call deadline.
  - A thread cannot be stopped, though, so an answer that could keep sympy busy without
    end (a power tower `9^{9^{9}}`, a factorial of an expression, a huge binomial: seen
    to hang) never reaches math-verify; it is judged by normalised string alone
    (`_too_costly`). This is a guard for the shapes known to hang, not a proof.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from hybridflow.reward.scorers._common import (
    Score,
    canonical_number,
    check_text,
    number_option,
    result,
)

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _braced(text: str, start: int) -> str | None:
    """The content of the brace group opening at text[start] ('{'); None if unclosed."""
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":  # `\{` and `\}` are literal braces, not grouping
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed`/`\\fbox` in `text`; None if absent or malformed.

    The last command decides: an unclosed `\\boxed{...` at the end (a truncated rollout)
    is no answer, not a fallback to an earlier, abandoned box.
    """
    matches = list(_BOX.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    j = i
    while j < len(text) and text[j] in " \t":
        j += 1
    if j < len(text) and text[j] == "{":
        content = _braced(text, j)
    elif j > i:  # `\boxed 5`: the argument runs to the end of the math or the line
        content = re.split(r"[$\n]", text[j:], maxsplit=1)[0]
    else:
        return None
    if content is None or not content.strip():
        return None
    return content.strip()


# ---- string normalisation (the fallback, and `pred`) ---------------------------------

# `12\text{ cm}`, `5\text{ m}^2`: a unit is text set off by a space (verl's rule too)
_TEXT_UNIT = re.compile(r"\\(?:text|mbox|mathrm)\{\s+[^{}]*\}(?:\^\{?\d\}?)?")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")  # `\text{Monday}`
_FRAC = re.compile(r"\\frac(?:\{([^{}]*)\}|([0-9A-Za-z]))(?:\{([^{}]*)\}|([0-9A-Za-z]))")
_SQRT = re.compile(r"\\sqrt([0-9A-Za-z])")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)")
_SLASH = re.compile(r"(-?\d+)/(\d+)")


def normalize_answer(answer: str) -> str:
    """A canonical string of a LaTeX answer, in the spirit of verl's `math` / `math_dapo`.

    `\\left(` -> `(`, `\\dfrac` -> `\\frac`, `\\frac12` -> `\\frac{1}{2}`, `1/2` -> `\\frac{1}{2}`,
    `90^\\circ` -> `90`, `12\\text{ cm}` -> `12`, `\\text{A}` -> `A`, `x = 5` -> `5`,
    `1,000` -> `1000`, `5.0` -> `5`; spaces, `$`, `%`, `\\!` and a final `.` removed.
    """
    s = answer.strip().replace("\n", "")
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = _TEXT_UNIT.sub("", s)
    s = _TEXT.sub(r"\1", s)
    s = re.sub(r"\\[!,;: ]", "", s)  # LaTeX spacing commands
    s = s.replace(" ", "").rstrip(".")
    lhs, eq, rhs = s.partition("=")
    if eq and len(lhs) <= 2 and "=" not in rhs:  # `x=5`, `k=3`: the value is the answer
        s = rhs
    s = _SQRT.sub(r"\\sqrt{\1}", s)
    s = _FRAC.sub(lambda m: f"\\frac{{{m[1] or m[2]}}}{{{m[3] or m[4]}}}", s)
    if m := _SLASH.fullmatch(s):
        s = f"\\frac{{{m[1]}}}{{{m[2]}}}"
    if _THOUSANDS.fullmatch(s):  # only grouped thousands: `1,2` is a pair, not 12
        s = s.replace(",", "")
    if _NUMBER.fullmatch(s):
        s = canonical_number(s) or s
    return s


# ---- math-verify ------------------------------------------------------------------------

_MAX_VERIFY_CHARS = 400  # no real final answer is longer; sympy time grows with size


def _exponents(latex: str) -> list[str]:
    out = []
    for m in re.finditer(r"\^\s*", latex):
        j = m.end()
        if j < len(latex) and latex[j] == "{":
            out.append(_braced(latex, j) or latex[j:])
        else:
            out.append(re.match(r"\d*", latex[j:])[0])
    return out


def _too_costly(latex: str) -> bool:
    """True for answers that sympy may evaluate without end (see the module docstring)."""
    if len(latex) > _MAX_VERIFY_CHARS:
        return True
    for exponent in _exponents(latex):
        if "^" in exponent or "!" in exponent or len(re.sub(r"\D", "", exponent)) > 5:
            return True  # a tower, or an exponent of 10^6 and more
    if re.search(r"[)}\]]\s*!", latex) or re.search(r"\d{5,}\s*!", latex):
        return True  # the factorial of an expression, or of 10^4 and more
    return bool(re.search(r"binom|choose", latex) and re.search(r"\d{5,}", latex))


@functools.cache
def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as exc:  # not installed, or installed with an unsupported ANTLR
        raise ImportError(
            f"the `math` scorer checks answers with math-verify, which cannot be imported "
            f"({exc}): pip install 'hybridflow[math]'"
        ) from exc
    return math_verify


@functools.lru_cache(maxsize=4096)  # one ground truth is scored against n rollouts
def _parse(latex: str) -> tuple:
    mv = _math_verify()
    configs = (mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig())
    # The box hands math-verify exactly our answer, so its own extraction cannot pick
    # another number out of it.
    return tuple(
        mv.parse("\\boxed{" + latex + "}", extraction_config=configs, parsing_timeout=None)
    )


def is_equiv(ground_truth: str, answer: str) -> bool:
    """math-verify's equivalence, else normalised string equality."""
    mv = _math_verify()
    if not (_too_costly(ground_truth) or _too_costly(answer)):
        gold, pred = _parse(ground_truth), _parse(answer)
        # verify is asymmetric: gold first. It returns False on its own errors.
        if gold and pred and mv.verify(list(gold), list(pred), timeout_seconds=None):
            return True
    return normalize_answer(ground_truth) == normalize_answer(answer)


def _ground_truth(ground_truth: Any) -> str:
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, str | int | float):
        raise TypeError(f"math: ground_truth must be a str or number, got {ground_truth!r}")
    text = str(ground_truth).strip()
    return (last_boxed(text) or text) if _BOX.search(text) else text


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    format_score: float = 0.0,
    score: float = 1.0,
) -> Score:
    """Reward one boxed-answer response; see the module docstring."""
    check_text("math: solution_str", solution_str)
    _math_verify()  # a missing dependency fails every call, not only those with a box
    format_score = number_option(extra_info, "format_score", format_score)
    score = number_option(extra_info, "score", score)
    answer = last_boxed(solution_str)
    if answer is None:
        return result(0.0, False, "")
    correct = is_equiv(_ground_truth(ground_truth), answer)
    return result(score if correct else format_score, correct, normalize_answer(answer))

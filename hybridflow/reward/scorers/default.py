"""Pick the scorer by `data_source`, as verl's `default_compute_score` does.

    default_compute_score(data_source, solution_str, ground_truth, extra_info=None) -> Score

  gsm8k      "openai/gsm8k", "gsm8k"
  math       "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
             "HuggingFaceH4/MATH-500", "math"
  countdown  any data_source containing "countdown" (TinyZero's rule:
             "countdown", "Jiayi-Pan/Countdown-Tasks-3to4", ...)

Invariant: an unknown data_source raises ValueError naming it and the known ones;
a sample is never scored by a guess. Each scorer runs with its default options.
"""

from __future__ import annotations

from typing import Any

from hybridflow.reward.scorers import countdown, gsm8k
from hybridflow.reward.scorers import math as boxed_math
from hybridflow.reward.scorers._common import Score

DATA_SOURCES = {
    "openai/gsm8k": gsm8k.compute_score,
    "gsm8k": gsm8k.compute_score,
    "lighteval/MATH": boxed_math.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": boxed_math.compute_score,
    "HuggingFaceH4/MATH-500": boxed_math.compute_score,
    "math": boxed_math.compute_score,
}


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
) -> Score:
    """Score one sample with the scorer its `data_source` names."""
    fn = DATA_SOURCES.get(data_source)
    if fn is None and isinstance(data_source, str) and "countdown" in data_source.lower():
        fn = countdown.compute_score
    if fn is None:
        known = ", ".join(repr(k) for k in DATA_SOURCES)
        raise ValueError(
            f"no built-in scorer for data_source {data_source!r}; known: {known}, "
            "or any name containing 'countdown'"
        )
    return fn(data_source, solution_str, ground_truth, extra_info)

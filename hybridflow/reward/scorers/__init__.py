"""Built-in answer verifiers for reasoning RL, in verl's per-sample reward signature.

    compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None)
        -> {"score": float, "acc": 1.0 | 0.0, "pred": str}

so a verl user's own reward function and these plug in the same way. `score` is the
reward; `acc` whether the answer is right; `pred` the extracted answer, normalised so
that equal answers are equal strings (it is what maj@n votes on), "" when none was found.

Modules, one task each:
  gsm8k      `#### N` (strict) or the last number (flexible), compared as numbers
  math       the last `\\boxed{}`, equivalence by math-verify (extra `hybridflow[math]`)
             with a string-normalisation fallback
  countdown  an `<answer>` equation over the given numbers, evaluated without eval
  default    dispatch on `data_source`, like verl's `default_compute_score`

`SCORERS` names each as "module:function", the form `package.module:function` reward
settings take; `scorer_target` resolves a name or raises a ConfigError that lists the
known ones. Options (`method`, `format_score`, `score`) come from the sample's
`extra_info`, else the function's keyword arguments.

Invariant: importing this package imports no scorer module, no math-verify, no torch.
"""

from __future__ import annotations

import difflib

from hybridflow.errors import ConfigError

_PACKAGE = "hybridflow.reward.scorers"

SCORERS: dict[str, str] = {
    "gsm8k": f"{_PACKAGE}.gsm8k:compute_score",
    "math": f"{_PACKAGE}.math:compute_score",
    "countdown": f"{_PACKAGE}.countdown:compute_score",
    "default": f"{_PACKAGE}.default:default_compute_score",
}

__all__ = ["SCORERS", "scorer_target"]


def scorer_target(name: str, path: str) -> str:
    """The "module:function" of the built-in scorer `name`; `path` is the config key."""
    target = SCORERS.get(name)
    if target is not None:
        return target
    close = difflib.get_close_matches(str(name), list(SCORERS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(path, f"unknown scorer {name!r}; known: {', '.join(SCORERS)}{hint}")

"""Validation metrics: per-sample scores of a held-out set -> the `val/` metrics row.

Consumes one `ValSample` per generated sample (which prompt it answers, the prompt's
`data_source`, its reward, the scorer's extras from `reward_info` such as `acc` and
`pred`, its response length) and produces, for n samples per prompt:

  val/reward/mean                     mean reward over every sample
  val/response_length/mean            mean response tokens
  val/<data_source>/<m>/mean          m = reward and every numeric extra (acc, ...)
  with n > 1 also, per data source and metric:
  val/<data_source>/<m>/mean@n        mean over prompts of the mean over its n samples
  val/<data_source>/<m>/best@n        mean over prompts of the best of its n samples
  val/<data_source>/<m>/maj@n         mean over prompts of m of the majority answer: the
                                      most frequent `pred` among its n samples (ties: the
                                      one seen first), scored by a sample that gave it;
                                      only when the scorer returns `pred`

verl reports the same family (`mean@N`, `best@N`, `maj@N`), estimated by bootstrap over
subsets; here each is exact for the n samples drawn.

Invariant: pure functions of their inputs (no I/O), the same for every run; a prompt
with fewer than n samples (never, when the runtime collected them all) still counts
with the samples it has.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

PREFIX = "val/"


@dataclass(frozen=True)
class ValSample:
    prompt: int  # the prompt's number in the validation set
    data_source: str
    reward: float
    response_length: int
    extras: dict[str, float | str] = field(default_factory=dict)


def is_validation_row(metrics: dict[str, float]) -> bool:
    """Whether a metrics row is a validation row (every key `val/...`)."""
    return bool(metrics) and all(k.startswith(PREFIX) for k in metrics)


def validation_metrics(samples: Sequence[ValSample], n: int) -> dict[str, float]:
    if not samples:
        return {}
    out = {
        "val/reward/mean": _mean([s.reward for s in samples]),
        "val/response_length/mean": _mean([float(s.response_length) for s in samples]),
    }
    by_source: dict[str, dict[int, list[ValSample]]] = defaultdict(lambda: defaultdict(list))
    for s in samples:
        by_source[s.data_source or "unknown"][s.prompt].append(s)
    for source, prompts in sorted(by_source.items()):
        groups = list(prompts.values())
        flat = [s for g in groups for s in g]
        for name in _metric_names(flat):
            key = f"{PREFIX}{source}/{name}"
            out[f"{key}/mean"] = _mean([v for s in flat if (v := _value(s, name)) is not None])
            if n <= 1:
                continue
            per_prompt = [[v for s in g if (v := _value(s, name)) is not None] for g in groups]
            per_prompt = [vs for vs in per_prompt if vs]
            out[f"{key}/mean@{n}"] = _mean([_mean(vs) for vs in per_prompt])
            out[f"{key}/best@{n}"] = _mean([max(vs) for vs in per_prompt])
            if all(isinstance(s.extras.get("pred"), str) for s in flat):
                out[f"{key}/maj@{n}"] = _mean([_majority(g, name) for g in groups])
    return out


def _metric_names(samples: Sequence[ValSample]) -> list[str]:
    """`reward`, then every extra that is a number in some sample (in first-seen order)."""
    names = ["reward"]
    for s in samples:
        for key, v in s.extras.items():
            if isinstance(v, float) and key not in names and key != "reward":
                names.append(key)
    return names


def _value(s: ValSample, name: str) -> float | None:
    if name == "reward":
        return s.reward
    v = s.extras.get(name)
    return v if isinstance(v, float) else None


def _majority(group: Sequence[ValSample], name: str) -> float:
    """`name` of the majority answer of one prompt's samples."""
    votes = Counter(str(s.extras.get("pred", "")) for s in group)
    top = max(votes.values())
    winner = next(p for p in (str(s.extras.get("pred", "")) for s in group) if votes[p] == top)
    for s in group:
        if str(s.extras.get("pred", "")) == winner:
            v = _value(s, name)
            return v if v is not None else math.nan
    return math.nan


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan

"""What a reward is allowed to be: the one check every reward backend's values pass.

Rewards land in a float32 tensor `rewards  # [B]`, so a reward is a real number (not a
bool, not a string, not a dict) that is finite *in float32*: 1e39 is finite as a Python
float and +inf after the cast, and 10**400 cannot even be converted. Each of those
would otherwise surface later as a NaN loss blamed on `actor.update`.

Two shapes of result exist:
  - batched (the function backend's documented signature, the reward-service app): a
    sequence of exactly B numbers, checked by `reward_list`;
  - per sample (verl's `compute_score` signature, hybridflow.reward.scorers): a number,
    or a dict whose `score` is the reward and whose other keys are extra information
    (`acc`, `pred`, ...), split by `split_result`.

Both raise `BadReward(index, message)`; each backend turns it into its own error type
(RewardFunctionError, a 4xx reply, ...) naming itself and the sample, in one place each.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

# The largest float32: a reward beyond it becomes +-inf in the `rewards` tensor.
FLOAT32_MAX = 3.4028234663852886e38
# Extra keys of a per-sample result that are kept as strings (e.g. `pred`) are cut here:
# they travel per sample in `reward_info` and a 1 MB "prediction" is a bug, not data.
MAX_EXTRA_CHARS = 512


_NO_VALUE = object()


class BadReward(ValueError):
    """A reward value is not a finite float32 number. `index`: the sample (-1: the whole
    result, e.g. a wrong count); `value`: the offending value as shown (repr, cut);
    `why`: what is wrong. str() reads "<value>: <why>" (or just <why>)."""

    def __init__(self, index: int, why: str, value: Any = _NO_VALUE) -> None:
        self.index, self.why = index, why
        self.value = "" if value is _NO_VALUE else _show(value)
        super().__init__(f"{self.value}: {why}" if self.value else why)


def reward_number(value: Any, index: int = -1) -> float:
    """One reward -> float; BadReward unless a real number finite in float32."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        what = "a dict" if isinstance(value, Mapping) else type(value).__name__
        raise BadReward(index, f"{what}, expected a number", value)
    try:
        f = float(value)
    except OverflowError:  # an int such as 10**400
        raise BadReward(index, "does not fit a float32", value) from None
    if not math.isfinite(f):
        raise BadReward(index, "rewards must be finite", f)
    if abs(f) > FLOAT32_MAX:
        raise BadReward(index, "beyond float32's range (it would become inf)", f)
    return f


def reward_list(out: Any, n: int) -> list[float]:
    """A batched result -> n floats. A dict (whose iteration gives its keys), a string,
    a tensor of the wrong size or a wrong count is a BadReward, never a reward."""
    if hasattr(out, "detach") and hasattr(out, "reshape"):  # a torch tensor
        out = out.detach().cpu().reshape(-1).tolist() if out.dim() <= 1 else out
    if isinstance(out, Mapping):
        raise BadReward(
            -1,
            f"a dict with keys {sorted(map(str, out))[:8]}, expected a list of {n} numbers "
            "(a per-sample dict {'score': ...} belongs to verl's signature)",
        )
    if isinstance(out, str | bytes) or not hasattr(out, "__iter__"):
        raise BadReward(-1, f"{type(out).__name__}, expected a list of {n} numbers")
    values = list(out)
    if len(values) != n:
        raise BadReward(-1, f"{len(values)} values for {n} samples")
    return [reward_number(v, i) for i, v in enumerate(values)]


def split_result(value: Any, index: int = -1) -> tuple[float, dict[str, float | str]]:
    """A per-sample result -> (reward, extras). A number is the reward; a dict must hold
    a `score` number, and every other key with a number (bools as 0/1) or string value
    is an extra. Other extra values (lists, None) are dropped: they cannot be averaged
    or voted on."""
    if not isinstance(value, Mapping):
        return reward_number(value, index), {}
    if "score" not in value:
        raise BadReward(index, f"a dict without 'score' (keys: {sorted(map(str, value))[:8]})")
    score = reward_number(value["score"], index)
    extras: dict[str, float | str] = {}
    for key, v in value.items():
        if key == "score" or not isinstance(key, str):
            continue
        if isinstance(v, bool):
            extras[key] = float(v)
        elif isinstance(v, numbers.Real):
            try:
                extras[key] = reward_number(v, index)
            except BadReward as exc:
                raise BadReward(index, f"extra {key!r}: {exc.why}", v) from None
        elif isinstance(v, str):
            extras[key] = v[:MAX_EXTRA_CHARS]
    return score, extras


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

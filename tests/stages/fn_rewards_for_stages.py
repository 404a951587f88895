"""Reward functions used by test_stages_reward.py (imported by name, like a user's)."""

from __future__ import annotations

import math

NOT_CALLABLE = 3


def echo_group(prompts, responses, prompt_ids, response_ids, metadata):
    return [
        float(m["group_index"]) + len(r) / 100 for r, m in zip(response_ids, metadata, strict=True)
    ]


def fails_on_bad(prompts, responses, prompt_ids, response_ids, metadata):
    return [1.0 / (0 if m.get("id") == "bad" else 1) for m in metadata]


def fails_on_batches(prompts, responses, prompt_ids, response_ids, metadata):
    if len(prompts) > 1:
        raise RuntimeError("batched calls unsupported")
    return [0.0]


def returns_nan(prompts, responses, prompt_ids, response_ids, metadata):
    return [0.0] * (len(prompts) - 1) + [math.nan]


def returns_short(prompts, responses, prompt_ids, response_ids, metadata):
    return [0.0] * (len(prompts) - 1)


def returns_text(prompts, responses, prompt_ids, response_ids, metadata):
    return ["1.0"] * len(prompts)


def returns_dict(prompts, responses, prompt_ids, response_ids, metadata):
    return {"score": [1.0] * len(prompts)}


def returns_huge(prompts, responses, prompt_ids, response_ids, metadata):
    return [0.0, 1e39, 0.0][: len(prompts)]


def returns_overflow(prompts, responses, prompt_ids, response_ids, metadata):
    return [10**400] * len(prompts)


# -- verl's per-sample signature (compute_score) --------------------------------------


def verl_exact(data_source, solution_str, ground_truth, extra_info=None):
    """A verl-style scorer: a dict with score, acc, pred and a per-source bonus key."""
    pred = solution_str.strip()
    acc = float(pred == str(ground_truth))
    return {"score": acc, "acc": acc, "pred": pred, "len": float(len(pred)), "src": data_source}


def verl_float_no_extra_info(data_source, solution_str, ground_truth):
    return 0.5 if extra_marker(ground_truth) else 0.25


def extra_marker(ground_truth):
    return ground_truth == "9"


def verl_sees_extra_info(data_source, solution_str, ground_truth, extra_info=None):
    return float(extra_info["weight"])


async def verl_async(data_source, solution_str, ground_truth, extra_info=None):
    import asyncio

    await asyncio.sleep(0.05)
    return float(solution_str.strip() == ground_truth)


def verl_raises_on_7(data_source, solution_str, ground_truth, extra_info=None):
    if "7" in solution_str:
        raise ValueError("cannot parse 7")
    return 1.0


def verl_hangs_on_7(data_source, solution_str, ground_truth, extra_info=None):
    import time

    if "7" in solution_str:
        time.sleep(30)  # abandoned at the deadline: a daemon thread, never joined
    return 1.0


def verl_always_raises(data_source, solution_str, ground_truth, extra_info=None):
    raise RuntimeError("broken")


def verl_returns_inf(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": math.inf if "7" in solution_str else 1.0}

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

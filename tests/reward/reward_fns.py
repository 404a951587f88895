"""Reward functions that the CLI tests serve with `python -m hybridflow reward-serve
tests.reward.reward_fns:<name>` (this module is imported by the server subprocess)."""

from __future__ import annotations

import asyncio


def length_reward(prompts, responses, prompt_ids, response_ids, metadata):
    """Reward = number of response tokens (+ metadata["bonus"] if given)."""
    return [len(r) + float(m.get("bonus", 0)) for r, m in zip(response_ids, metadata, strict=True)]


async def slow_length_reward(prompts, responses, *, prompt_ids, response_ids, metadata):
    """Async and keyword-only: sleeps metadata[0]["sleep_s"] seconds first."""
    await asyncio.sleep(float(metadata[0].get("sleep_s", 0)) if metadata else 0)
    return [float(len(r)) for r in response_ids]


NOT_CALLABLE = 3

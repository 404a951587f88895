"""Reward functions that the CLI tests serve with `python -m hybridflow reward-serve
tests.reward.reward_fns:<name>` (this module is imported by the server subprocess)."""

from __future__ import annotations

import asyncio
from pathlib import Path


def length_reward(prompts, responses, prompt_ids, response_ids, metadata):
    """Reward = number of response tokens (+ metadata["bonus"] if given)."""
    return [len(r) + float(m.get("bonus", 0)) for r, m in zip(response_ids, metadata, strict=True)]


async def slow_length_reward(prompts, responses, *, prompt_ids, response_ids, metadata):
    """Async and keyword-only: creates the file metadata[0]["touch"] (if given) to say it
    started, then sleeps metadata[0]["sleep_s"] seconds."""
    first = metadata[0] if metadata else {}
    if first.get("touch"):
        Path(first["touch"]).write_text("started")
    await asyncio.sleep(float(first.get("sleep_s", 0)))
    return [float(len(r)) for r in response_ids]


NOT_CALLABLE = 3

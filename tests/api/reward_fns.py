"""A reward function for free-text prompts (imported by name in a stage process:
`tests.api.reward_fns:brevity_reward`; the launcher puts the repository on its path)."""

from __future__ import annotations


def brevity_reward(prompts, responses, prompt_ids, response_ids, metadata):
    """1 / (1 + response tokens): any prompt, any response, a score in (0, 1]."""
    return [1.0 / (1.0 + len(r)) for r in response_ids]

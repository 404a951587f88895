"""A synthetic environment of fixed shape, for benchmarks and engine tests: every
trajectory runs exactly `turns` model turns, each answered (but the last) by an
observation of `obs_tokens` token ids after `latency_s` seconds (an async sleep: a tool or
service that takes that long without holding a thread).

    env: fixed_turns             # hybridflow.stages.env.builtin.fixed_turns:FixedTurnsEnv
    env_options: {turns: 4, obs_tokens: 32, latency_s: 0.05}

Nothing depends on what the model writes, so a random model gives a workload whose size
is set by the options alone (with `stop_on_eos: false`, every turn is max_new_tokens
long). The observation ids are drawn from [token_low, token_high) by a RNG seeded from
(seed, the record's `id` or 0, turn): the same trajectory sees the same tokens in every
run. The done step's reward is 1.0; every other is 0.0.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from hybridflow.stages.env.protocol import Action, Observation, StepResult

__all__ = ["FixedTurnsEnv"]


class FixedTurnsEnv:
    def __init__(
        self,
        *,
        turns: int = 3,
        obs_tokens: int = 16,
        latency_s: float = 0.0,
        token_low: int = 2,
        token_high: int = 100,
        seed: int = 0,
    ) -> None:
        if turns < 1 or obs_tokens < 1 or latency_s < 0 or not 0 <= token_low < token_high:
            raise ValueError(
                "need turns >= 1, obs_tokens >= 1, latency_s >= 0, 0 <= token_low < token_high"
            )
        self.turns, self.obs_tokens, self.latency_s = turns, obs_tokens, latency_s
        self.low, self.high, self.seed = token_low, token_high, seed
        self.turn = 0
        self.key: Any = 0

    def reset(self, record: dict[str, Any]) -> Observation:
        self.turn, self.key = 0, record.get("id", 0)
        return Observation.empty()  # the row's own prompt

    async def step(self, action: Action) -> StepResult:
        self.turn += 1
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if self.turn >= self.turns:
            return StepResult(Observation.empty(), 1.0, True, {})
        rng = random.Random(f"{self.seed}/{self.key}/{self.turn}")
        ids = [rng.randrange(self.low, self.high) for _ in range(self.obs_tokens)]
        return StepResult(Observation.from_tokens(ids), 0.0, False, {})

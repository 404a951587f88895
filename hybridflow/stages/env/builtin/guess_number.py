"""Guess the number: a multi-turn game whose only reward comes at the end.

    records = make_records(64, seed=0)     # dataset rows, verl's RL layout
    env: guess_number                      # ...builtin.guess_number:GuessNumberEnv
    env_options: {max_turns: 7}

The record's secret is `reward_model.ground_truth`; `extra_info` may set the range
(`low`, `high`) and `max_turns` per record, else the environment's options hold. Each
model turn is one guess: the last integer in the turn's text.

    guess < secret       -> "Higher. N guesses left."   reward 0, not done
    guess > secret       -> "Lower. N guesses left."    reward 0, not done
    no integer / outside the range -> a reminder, and the turn counts
    guess == secret      -> done, reward = 1 - turn_bonus * (turns - 1) / (max_turns - 1)
    max_turns spent      -> done, reward 0

so a win scores 1 with `turn_bonus` 0 (the default), and between 1 - turn_bonus (last
guess) and 1 (first guess) otherwise; a loss scores 0. Binary search wins any range of
up to 2**max_turns - 1 numbers: the default 1..100 in 7 guesses.

`info`: `invalid_guess` (1 on a turn without a valid guess) every step, `won` on the done
step. Observations are `user` messages.

Invariants: `make_records` is deterministic in (n, seed, low, high, max_turns), in every
process (a str-seeded RNG); a record's secret lies in its range; the reward is nonzero
only on the done step.
"""

from __future__ import annotations

import random
import re
from typing import Any

from hybridflow.stages.env.protocol import Action, EnvError, InfoValue, Observation, StepResult

__all__ = ["DATA_SOURCE", "GuessNumberEnv", "make_records", "prompt_text"]

DATA_SOURCE = "hybridflow/guess_number"
_INTEGER = re.compile(r"-?\d+")
_MAX_SCAN = 4096  # only the tail of a turn is searched for the guess


def prompt_text(low: int, high: int, max_turns: int) -> str:
    return (
        f"I am thinking of an integer from {low} to {high}. You have {max_turns} guesses. "
        "Answer each turn with one number; after each wrong guess I will say whether "
        "the number is higher or lower."
    )


def make_records(
    n: int, seed: int, *, low: int = 1, high: int = 100, max_turns: int = 7
) -> list[dict[str, Any]]:
    """`n` games with secrets drawn uniformly from [low, high]."""
    _check_range(low, high, max_turns, "make_records")
    rng = random.Random(f"guess_number:{seed}")
    out = []
    for i in range(n):
        secret = rng.randint(low, high)
        out.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": prompt_text(low, high, max_turns)}],
                "ability": "game",
                "reward_model": {"style": "rule", "ground_truth": str(secret)},
                "extra_info": {"index": i, "low": low, "high": high, "max_turns": max_turns},
            }
        )
    return out


def _check_range(low: int, high: int, max_turns: int, where: str) -> None:
    if not (isinstance(low, int) and isinstance(high, int) and low <= high):
        raise ValueError(f"{where}: need integers low <= high, got {low!r}, {high!r}")
    if not (isinstance(max_turns, int) and max_turns >= 1):
        raise ValueError(f"{where}: max_turns must be an integer >= 1, got {max_turns!r}")


class GuessNumberEnv:
    def __init__(
        self, *, low: int = 1, high: int = 100, max_turns: int = 7, turn_bonus: float = 0.0
    ) -> None:
        _check_range(low, high, max_turns, "GuessNumberEnv")
        if not 0.0 <= turn_bonus <= 1.0:
            raise ValueError(f"GuessNumberEnv: turn_bonus must be in [0, 1], got {turn_bonus}")
        self.low, self.high, self.max_turns = low, high, max_turns
        self.turn_bonus = float(turn_bonus)
        self.secret: int | None = None
        self.turns = 0

    def reset(self, record: dict[str, Any]) -> Observation:
        extra = record.get("extra_info") or {}
        self.low = int(extra.get("low", self.low))
        self.high = int(extra.get("high", self.high))
        self.max_turns = int(extra.get("max_turns", self.max_turns))
        _check_range(self.low, self.high, self.max_turns, "GuessNumberEnv.reset")
        try:
            secret = int(str((record.get("reward_model") or {})["ground_truth"]).strip())
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvError(
                f"GuessNumberEnv.reset: the record needs an integer reward_model.ground_truth "
                f"({type(exc).__name__}: {exc})",
                what="GuessNumberEnv.reset",
            ) from None
        if not self.low <= secret <= self.high:
            raise EnvError(
                f"GuessNumberEnv.reset: secret {secret} is outside [{self.low}, {self.high}]",
                what="GuessNumberEnv.reset",
            )
        self.secret, self.turns = secret, 0
        return Observation.empty()

    def guess(self, text: str) -> int | None:
        """The turn's guess: its last integer, when it lies in the range."""
        found = _INTEGER.findall(text[-_MAX_SCAN:])
        if not found:
            return None
        if len(found[-1]) > 18:  # far outside any range; int() of it would be wasted work
            return None
        value = int(found[-1])
        return value if self.low <= value <= self.high else None

    def step(self, action: Action) -> StepResult:
        if self.secret is None:
            raise EnvError("GuessNumberEnv.step before reset", what="GuessNumberEnv.step")
        self.turns += 1
        value = self.guess(action.text)
        info: dict[str, InfoValue] = {"invalid_guess": int(value is None)}
        if value == self.secret:
            return StepResult(Observation.empty(), self._win_reward(), True, {**info, "won": 1})
        left = self.max_turns - self.turns
        if left <= 0:
            return StepResult(Observation.empty(), 0.0, True, {**info, "won": 0})
        if value is None:
            say = f"Answer with one integer from {self.low} to {self.high}."
        else:
            say = "Higher." if value < self.secret else "Lower."
        say += f" {left} guess{'es' if left != 1 else ''} left."
        return StepResult(
            Observation.from_messages([{"role": "user", "content": say}]), 0.0, False, info
        )

    def _win_reward(self) -> float:
        if self.max_turns == 1:
            return 1.0
        return 1.0 - self.turn_bonus * (self.turns - 1) / (self.max_turns - 1)

"""Helpers for the multi-turn rollout tests: a chat template on the built-in tokenizer,
scripted environments (importable by `mt_helpers:Class`), a scripted turn engine, and
prompt batches with their records."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, ClassVar

import torch

from hybridflow.data.batching import encode_metadata, pad_left
from hybridflow.models import builtin_tokenizer
from hybridflow.stages.env.protocol import Action, Observation, StepResult
from hybridflow.stages.rollout.multiturn import TurnOutput, TurnRequest

# role line, content, <eos>, newline (the shape of tests/env/env_helpers.py's SIMPLE)
SIMPLE = (
    "{%- for m in messages -%}{{- m.role + ':\\n' + m.content + eos_token + '\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'assistant:\\n' -}}{%- endif -%}"
)


def chat_tokenizer() -> Any:
    tok = builtin_tokenizer()
    tok.chat_template = SIMPLE
    return tok


def tokenizer_dir(path: Path) -> str:
    """The built-in tokenizer with SIMPLE saved as a directory (what stage options name)."""
    chat_tokenizer().save_pretrained(path)
    return str(path)


def prompt_batch(tok: Any, records: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Records with a `prompt` (chat messages) -> prompt_ids/prompt_mask/metadata_json."""
    texts = [
        tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in records
    ]
    ids, mask = pad_left([tok.encode(t, add_special_tokens=False) for t in texts], tok.pad_token_id)
    meta = [{k: v for k, v in r.items() if k != "prompt"} for r in records]
    return {"prompt_ids": ids, "prompt_mask": mask, "metadata_json": encode_metadata(meta)}


def countdown_records(turns: list[int]) -> list[dict[str, Any]]:
    return [
        {
            "prompt": [{"role": "user", "content": f"Say anything {t} times."}],
            "extra_info": {"turns": t},
        }
        for t in turns
    ]


class CountdownEnv:
    """Ends on the turn `record.extra_info.turns` with reward = turns + bonus; before
    that, observes "ok <k>" (a user message) and counts one tool call and (on odd turns)
    one tool error. `delay_s`: each step sleeps (async) that long; `fail_at`: that turn's
    step raises. Class-level counters record concurrency and closes."""

    in_flight: ClassVar[int] = 0
    peak: ClassVar[int] = 0
    closed: ClassVar[int] = 0

    def __init__(self, *, delay_s: float = 0.0, fail_at: int = -1, bonus: float = 0.0) -> None:
        self.delay_s, self.fail_at, self.bonus = delay_s, fail_at, bonus
        self.turns = 0
        self.limit = 0
        self.texts: list[str] = []

    @classmethod
    def reset_counters(cls) -> None:
        cls.in_flight = cls.peak = cls.closed = 0

    def reset(self, record: dict[str, Any]) -> Observation:
        self.limit = int(record["extra_info"]["turns"])
        return Observation.empty()

    async def step(self, action: Action) -> StepResult:
        cls = CountdownEnv  # the counters are shared by the subclasses
        cls.in_flight += 1
        cls.peak = max(cls.peak, cls.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            self.turns += 1
            self.texts.append(action.text)
            if self.turns == self.fail_at:
                raise RuntimeError(f"scripted failure at turn {self.turns}")
            info = {"tool_calls": 1, "tool_errors": self.turns % 2}
            if self.turns >= self.limit:
                return StepResult(Observation.empty(), self.turns + self.bonus, True, info)
            obs = Observation.from_messages([{"role": "user", "content": f"ok {self.turns}"}])
            return StepResult(obs, 0.0, False, info)
        finally:
            cls.in_flight -= 1

    def close(self) -> None:
        CountdownEnv.closed += 1


class SlowResetEnv(CountdownEnv):
    def reset(self, record: dict[str, Any]) -> Observation:
        time.sleep(5.0)
        return Observation.empty()


class MessagesResetEnv(CountdownEnv):
    """reset replaces the dataset's prompt by its own conversation."""

    def reset(self, record: dict[str, Any]) -> Observation:
        super().reset(record)
        return Observation.from_messages([{"role": "user", "content": "A new prompt."}])


class ScriptedEngine:
    """A TurnEngine that answers request (key, turn) with [100 + key, 110 + turn, eos]
    (or `cut` tokens without the stop token), log-prob -0.5 each; it records requests."""

    def __init__(self, eos: int, cut: int = 0) -> None:
        self.eos, self.cut = eos, cut
        self.requests: list[tuple[int, TurnRequest]] = []

    async def generate(self, requests: list[TurnRequest], turn: int) -> list[TurnOutput]:
        out = []
        for r in requests:
            self.requests.append((turn, r))
            ids = [100 + r.key, 110 + turn, self.eos]
            if self.cut:
                ids = [100 + r.key] * self.cut
            ids = ids[: r.max_new_tokens]
            stopped = bool(ids) and ids[-1] == self.eos
            out.append(TurnOutput(ids, [-0.5] * len(ids), stopped))
        return out


class BadTokensEnv(CountdownEnv):
    """Observes token ids outside any vocabulary."""

    async def step(self, action: Action) -> StepResult:
        return StepResult(Observation.from_tokens([10**6]), 0.0, False, {})


class DigitsEnv:
    """Two turns; each step's reward is the number of digits in that turn's text (so the
    rewards vary between samples and sum over the turns). Importable by stage processes
    as `tests.rollout_multiturn.mt_helpers:DigitsEnv` (the launcher puts the repo root on
    their path)."""

    def __init__(self, turns: int = 2) -> None:
        self.turns, self.taken = turns, 0

    def reset(self, record: dict[str, Any]) -> Observation:
        return Observation.empty()

    def step(self, action: Action) -> StepResult:
        self.taken += 1
        reward = float(sum(c.isdigit() for c in action.text))
        if self.taken >= self.turns:
            return StepResult(Observation.empty(), reward, True, {})
        obs = Observation.from_messages([{"role": "user", "content": "More digits."}])
        return StepResult(obs, reward, False, {})

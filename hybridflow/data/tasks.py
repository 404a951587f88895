"""Built-in synthetic tasks with exact, graded rule rewards (for demos, tests, SFT-then-RL).

Each task generates prompts from a seed (same seed -> same prompts, in every process),
scores responses with an exact rule that gives partial credit (so GRPO sees a signal
long before a tiny model is perfect), and generates SFT examples.

Tasks (prompt -> ideal response):
  last_digit   "last:40719="   -> "9"     copy the prompt's last digit
      0.3 if the response starts with a digit, +0.2 if it is exactly one digit (it
      stopped), +0.5 if that digit is the right one.
  copy         "copy:472="     -> "472"   copy 2-4 digits
      0.8 * (share of answer positions matched, whitespace ignored) + 0.2 if exact.
  parity       "parity:1011="  -> "odd"   odd/even number of 1s
      1.0 exact; 0.7 right word + trailing text; 0.2 wrong word ("odd"/"even" format).
  word_problems  "Ann has 7 apples. ... after \"####\"."  -> "... #### 9"
      1.0 if the first number after the last "####" (or of the response, without one)
      is the answer, else 0: a benchmark task, whose prompts are as long as GSM8K's;
      its answer comes from the metadata only.

A random-init tiny model scores ~0.0-0.05 on each; `last_digit` climbs fastest (emitting
a digit then stopping is worth 0.55 on average before any copying is learned).

Reward functions have the documented batched signature, importable by name:
    fn(prompts: list[str], responses: list[str], prompt_ids: list[list[int]],
       response_ids: list[list[int]], metadata: list[dict]) -> list[float]
e.g. `hybridflow.data.tasks:last_digit_reward`. The expected answer comes from
`metadata[i]["answer"]` when present, else it is parsed from the prompt text (the last
match of the task's prompt pattern, so a chat template around it does no harm).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    sample: Callable[[random.Random], tuple[str, str]]  # rng -> (prompt, answer)
    score: Callable[[str, str], float]  # (response text, answer) -> reward in [0, 1]
    pattern: re.Pattern[str]  # finds the task's prompt in any text; group 1 = the input
    solve: Callable[[str], str]  # the input (pattern group 1) -> the answer
    answer_in_prompt: bool = True  # False: only the metadata's `answer` gives the answer

    @property
    def reward_function(self) -> str:
        return f"hybridflow.data.tasks:{self.name}_reward"

    def _rng(self, seed: int) -> random.Random:
        # A str seed is hashed with SHA-512 by `random`: stable across processes and runs
        # (unlike hash(), which is salted per process).
        return random.Random(f"hybridflow/{self.name}/{seed}")

    def prompts(self, n: int, seed: int) -> list[dict[str, Any]]:
        """`n` prompt records {prompt, answer, task, id}; deterministic in (task, seed)."""
        rng = self._rng(seed)
        out = []
        for i in range(n):
            prompt, answer = self.sample(rng)
            out.append(
                {
                    "prompt": prompt,
                    "answer": answer,
                    "task": self.name,
                    "id": f"{self.name}-{seed}-{i}",
                }
            )
        return out

    def sft_examples(self, n: int, seed: int) -> list[dict[str, str]]:
        """`n` supervised pairs {prompt, response} with the ideal response."""
        return [{"prompt": r["prompt"], "response": r["answer"]} for r in self.prompts(n, seed)]

    def answer_for(self, prompt: str, meta: dict[str, Any], index: int) -> str:
        answer = meta.get("answer") if isinstance(meta, dict) else None
        if isinstance(answer, str):
            return answer
        found = self.pattern.findall(prompt)
        if not found:
            raise ValueError(
                f"{self.name}_reward: sample {index} has no 'answer' in its metadata and "
                f"its prompt {prompt[-60:]!r} does not match the {self.name} format"
            )
        return self.solve(found[-1])

    def reward(
        self,
        prompts: list[str],
        responses: list[str],
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
        metadata: list[dict[str, Any]],
    ) -> list[float]:
        if not len(prompts) == len(responses) == len(metadata):
            raise ValueError(
                f"{self.name}_reward: got {len(prompts)} prompts, {len(responses)} "
                f"responses, {len(metadata)} metadata entries; they must match"
            )
        return [
            self.score(resp, self.answer_for(p, m, i))
            for i, (p, resp, m) in enumerate(zip(prompts, responses, metadata, strict=True))
        ]


# -- last_digit ----------------------------------------------------------------------------


def _sample_last_digit(rng: random.Random) -> tuple[str, str]:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
    return f"last:{digits}=", digits[-1]


def _score_last_digit(response: str, answer: str) -> float:
    s = response.strip()
    if not s or not s[0].isdigit():
        return 0.0
    r = 0.3
    if len(s) == 1:
        r += 0.2
    if s[0] == answer:
        r += 0.5
    return r


# -- word_problems -------------------------------------------------------------------------


def _sample_word_problem(rng: random.Random) -> tuple[str, str]:
    # Imported here: word_problems is a data module of its own, needed by this task only.
    from hybridflow.data import word_problems as wp

    question, _, answer = wp.sample_problem(rng, wp.Difficulty())
    return f"{question} {wp.INSTRUCTION}", str(answer)


def _score_word_problem(response: str, answer: str) -> float:
    tail = response.rsplit("####", 1)[-1].strip().split()  # after the last ####, if any
    return 1.0 if tail and tail[0].rstrip(".").replace(",", "") == answer else 0.0


def _no_answer_in_text(_: str) -> str:
    raise AssertionError("unreachable: the word_problems pattern matches nothing")


# -- copy ----------------------------------------------------------------------------------


def _sample_copy(rng: random.Random) -> tuple[str, str]:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 4)))
    return f"copy:{digits}=", digits


def _score_copy(response: str, answer: str) -> float:
    s = "".join(response.split())
    matched = sum(1 for a, b in zip(s, answer, strict=False) if a == b)
    # Integers until the last division: an exact copy scores exactly 1.0.
    return (8 * matched / len(answer) + (2 if s == answer else 0)) / 10


# -- parity --------------------------------------------------------------------------------


def _parity(bits: str) -> str:
    return "odd" if bits.count("1") % 2 else "even"


def _sample_parity(rng: random.Random) -> tuple[str, str]:
    bits = "".join(rng.choice("01") for _ in range(rng.randint(3, 6)))
    return f"parity:{bits}=", _parity(bits)


def _score_parity(response: str, answer: str) -> float:
    s = response.strip()
    if s == answer:
        return 1.0
    if s.startswith(answer):
        return 0.7
    if s.startswith(("odd", "even")):
        return 0.2
    return 0.0


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            "last_digit",
            "copy the prompt's last digit",
            _sample_last_digit,
            _score_last_digit,
            re.compile(r"last:(\d+)="),
            lambda digits: digits[-1],
        ),
        Task(
            "copy",
            "copy 2-4 digits",
            _sample_copy,
            _score_copy,
            re.compile(r"copy:(\d+)="),
            lambda digits: digits,
        ),
        Task(
            "parity",
            "say whether the number of 1s is odd or even",
            _sample_parity,
            _score_parity,
            re.compile(r"parity:([01]+)="),
            _parity,
        ),
        # GSM8K-shaped prompts of 100-200 characters (data/word_problems.py), for
        # benchmarks with realistic prompt lengths; the answer is only in the metadata.
        Task(
            "word_problems",
            "solve a 2-4 step arithmetic story, answer after ####",
            _sample_word_problem,
            _score_word_problem,
            re.compile(r"(?!)"),  # the answer cannot be read off the prompt
            _no_answer_in_text,
            answer_in_prompt=False,
        ),
    )
}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown built-in task {name!r}; known: {', '.join(TASKS)}") from None


# Importable reward functions (`hybridflow.data.tasks:<name>_reward`).
last_digit_reward = TASKS["last_digit"].reward
copy_reward = TASKS["copy"].reward
parity_reward = TASKS["parity"].reward
word_problems_reward = TASKS["word_problems"].reward

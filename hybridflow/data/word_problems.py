"""Synthetic GSM8K-style word problems, in verl's RL data format.

No GSM8K download is possible here, so examples/math_rl.py trains on these: short
stories of 2-3 arithmetic steps with a worked solution in GSM8K's style (one line per
step, the final answer after "####"):

  question  "Ann has 7 apples. She buys 5 more. Then she gives 3 to Bob.
             How many apples does Ann have now?"
  solution  "Ann has 7+5=12 apples.\\nShe gives 3 away: 12-3=9.\\n#### 9"

`generate(n, seed, split)` returns records shaped as verl's
`examples/data_preprocess/gsm8k.py` writes them:

  {"data_source": "hybridflow/word_problems",
   "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
   "ability": "math",
   "reward_model": {"style": "rule", "ground_truth": "9"},
   "extra_info": {"split": "train", "index": i, "answer": solution, "question": question}}

and `write_dataset(out_dir, n_train, n_test, seed)` writes train/test .parquet (or .jsonl).

`Difficulty` is the knob: how many steps, how large the numbers, which operations.

Invariants:
  - deterministic in (n, seed, split, difficulty), in every process (str-seeded RNG);
  - train and test never share a question, whatever the seeds: each question string
    belongs to exactly one split, by a hash of its text (1 in HELD_OUT to test), and a
    split's generator draws only the questions it owns; no question repeats in a split;
  - every number in a story and every intermediate result lies in 0..Difficulty.max_result,
    and the solution's arithmetic is exact (ground_truth is its last result).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

DATA_SOURCE = "hybridflow/word_problems"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
HELD_OUT = 8  # one question string in 8 belongs to the test split
SPLITS = ("train", "test")
_MAX_MISSES = 2000  # draws in a row without a new question of the split: give up
Op = Literal["add", "sub", "mul"]

_NAMES = (  # (name, subject pronoun, object pronoun)
    ("Ann", "She", "her"),
    ("Bob", "He", "him"),
    ("Cara", "She", "her"),
    ("Dan", "He", "him"),
    ("Eve", "She", "her"),
    ("Finn", "He", "him"),
    ("Gina", "She", "her"),
    ("Hugo", "He", "him"),
    ("Ivy", "She", "her"),
    ("Jack", "He", "him"),
)
_ITEMS = (
    "apples",
    "marbles",
    "stickers",
    "books",
    "coins",
    "cookies",
    "pencils",
    "cards",
    "shells",
    "stamps",
)
# op -> (story sentence, solution phrase); {s}/{o}: pronouns, {f}: a friend, {b}: the number
_PHRASES: dict[str, tuple[tuple[str, str], ...]] = {
    "add": (
        ("{s} buys {b} more.", "{s} buys {b} more"),
        ("{s} finds {b} more.", "{s} finds {b} more"),
        ("{f} gives {o} {b} more.", "{s} gets {b} more"),
    ),
    "sub": (
        ("{s} gives {b} to {f}.", "{s} gives {b} away"),
        ("{s} loses {b}.", "{s} loses {b}"),
        ("{s} sells {b}.", "{s} sells {b}"),
    ),
    "mul": (
        ("{s} ends up with {b} times as many.", "{s} has {b} times as many"),
        ("The number {s_lower} has grows {b} times.", "It grows {b} times"),
    ),
}
_SYMBOL = {"add": "+", "sub": "-", "mul": "*"}


@dataclass(frozen=True)
class Difficulty:
    """How hard the problems are: steps per problem, number sizes, operations."""

    min_steps: int = 2
    max_steps: int = 3
    max_number: int = 20  # numbers the story states (a multiplier: 2..max_factor)
    max_result: int = 60  # every intermediate result stays in 0..max_result
    ops: tuple[Op, ...] = ("add", "sub")
    max_factor: int = 3

    def validate(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got {self}")
        if not 1 <= self.max_number <= self.max_result:
            raise ValueError(f"need 1 <= max_number <= max_result, got {self}")
        if not self.ops or not set(self.ops) <= set(_SYMBOL):
            raise ValueError(f"ops must be a non-empty subset of {sorted(_SYMBOL)}")
        if "mul" in self.ops and self.max_factor < 2:
            raise ValueError("max_factor must be >= 2 when ops has 'mul'")


def split_of(question: str) -> str:
    """The split that owns `question` ("train" or "test"), fixed by its text."""
    digest = hashlib.sha256(question.encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % HELD_OUT == 0 else "train"


def sample_problem(rng: random.Random, difficulty: Difficulty) -> tuple[str, str, int]:
    """One problem -> (question, worked solution, answer)."""
    d = difficulty
    name, subj, obj = rng.choice(_NAMES)
    friend = rng.choice([n for n, _, _ in _NAMES if n != name])
    item = rng.choice(_ITEMS)
    value = rng.randint(min(2, d.max_number), d.max_number)  # no "1 apples"
    story = [f"{name} has {value} {item}."]
    lines: list[str] = []
    for k in range(rng.randint(d.min_steps, d.max_steps)):
        op, b = _next_op(rng, d, value)
        new = {"add": value + b, "sub": value - b, "mul": value * b}[op]
        told, said = rng.choice(_PHRASES[op])
        fill = {"s": subj, "o": obj, "f": friend, "b": b, "s_lower": subj.lower()}
        sentence = told.format(**fill)
        if k:  # "Then she buys 5 more." / "Then Bob gives her 5 more."
            sentence = "Then " + (
                sentence if told.startswith("{f}") else sentence[0].lower() + sentence[1:]
            )
        story.append(sentence)
        calc = f"{value}{_SYMBOL[op]}{b}={new}"
        lines.append(f"{name} has {calc} {item}." if k == 0 else f"{said.format(**fill)}: {calc}.")
        value = new
    story.append(f"How many {item} does {name} have now?")
    lines.append(f"#### {value}")
    return " ".join(story), "\n".join(lines), value


def _next_op(rng: random.Random, d: Difficulty, value: int) -> tuple[Op, int]:
    """An operation and its number keeping the result in 0..max_result."""
    choices: list[tuple[Op, int]] = []
    for op in d.ops:
        if op == "add" and value + 1 <= d.max_result:
            choices.append((op, rng.randint(1, min(d.max_number, d.max_result - value))))
        elif op == "sub" and value >= 1:
            choices.append((op, rng.randint(1, min(d.max_number, value))))
        elif op == "mul" and value >= 1 and value * 2 <= d.max_result:
            choices.append((op, rng.randint(2, min(d.max_factor, d.max_result // value))))
    if not choices:  # value == max_result with only add, or 0 with only sub/mul
        return ("sub", rng.randint(1, min(d.max_number, value))) if value else ("add", 1)
    return rng.choice(choices)


def make_record(question: str, solution: str, answer: int, split: str, index: int) -> dict:
    """One problem as a verl RL record."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "answer": solution, "question": question},
    }


def generate(
    n: int, seed: int = 0, split: str = "train", difficulty: Difficulty | None = None
) -> list[dict[str, Any]]:
    """`n` distinct problems owned by `split` (see `split_of`), as verl records."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    d = difficulty or Difficulty()
    d.validate()
    rng = random.Random(f"hybridflow/word_problems/{seed}/{split}")
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    misses = 0
    while len(out) < n:
        question, solution, answer = sample_problem(rng, d)
        if question in seen or split_of(question) != split:
            misses += 1
            if misses > _MAX_MISSES:  # the space is spent (a healthy test draw misses 7/8)
                raise ValueError(
                    f"only {len(out)} distinct {split} problems found for n={n} at {d}; "
                    "ask for fewer or raise the difficulty's ranges"
                )
            continue
        seen.add(question)
        misses = 0
        out.append(make_record(question, solution, answer, split, len(out)))
    return out


def write_dataset(
    out_dir: str | Path,
    n_train: int,
    n_test: int,
    seed: int = 0,
    fmt: Literal["parquet", "jsonl"] = "parquet",
    difficulty: Difficulty | None = None,
) -> tuple[Path, Path]:
    """train.<fmt> and test.<fmt> under `out_dir` (as verl's gsm8k preprocessing writes
    them) -> (train_path, test_path)."""
    if fmt not in ("parquet", "jsonl"):
        raise ValueError(f"fmt must be 'parquet' or 'jsonl', got {fmt!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", n_train), ("test", n_test)):
        records = generate(n, seed, split, difficulty)
        path = out / f"{split}.{fmt}"
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(records), path)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
        paths.append(path)
    return paths[0], paths[1]

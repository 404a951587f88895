"""Synthetic GSM8K-style word problems: verl's record layout, exact arithmetic, seeded,
train and test disjoint, and files the data sources read back."""

from __future__ import annotations

import re

import pytest

from hybridflow.data import word_problems as wp
from hybridflow.data.sources import load_records


def _check_solution(solution: str, ground_truth: str) -> None:
    """Every `a<op>b=c` in the solution is right, each step starts from the previous
    result, and the line after the last step is `#### <last result>`."""
    lines = solution.split("\n")
    assert lines[-1] == f"#### {ground_truth}"
    previous = None
    for line in lines[:-1]:
        (a, op, b, c), *_ = re.findall(r"(\d+)([+\-*])(\d+)=(\d+)", line)
        a, b, c = int(a), int(b), int(c)
        assert c == {"+": a + b, "-": a - b, "*": a * b}[op], line
        assert previous is None or a == previous, solution
        previous = c
    assert str(previous) == ground_truth


def test_records_have_verls_rl_layout_and_right_answers():
    records = wp.generate(200, seed=3, split="train")
    assert len(records) == 200
    for i, rec in enumerate(records):
        assert set(rec) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert rec["data_source"] == wp.DATA_SOURCE and rec["ability"] == "math"
        (message,) = rec["prompt"]
        info = rec["extra_info"]
        assert message == {"role": "user", "content": f"{info['question']} {wp.INSTRUCTION}"}
        assert rec["reward_model"]["style"] == "rule"
        assert info["split"] == "train" and info["index"] == i
        _check_solution(info["answer"], rec["reward_model"]["ground_truth"])
        assert info["question"].endswith("have now?")


def test_seeded_and_distinct():
    assert wp.generate(50, seed=1) == wp.generate(50, seed=1)
    assert wp.generate(50, seed=1) != wp.generate(50, seed=2)
    questions = [r["extra_info"]["question"] for r in wp.generate(500, seed=0)]
    assert len(set(questions)) == 500


def test_train_and_test_never_share_a_question_whatever_the_seeds():
    train = {r["extra_info"]["question"] for r in wp.generate(2000, seed=0, split="train")}
    for seed in (0, 1):
        test = wp.generate(300, seed=seed, split="test")
        assert {r["extra_info"]["split"] for r in test} == {"test"}
        assert not train & {r["extra_info"]["question"] for r in test}
        assert all(wp.split_of(r["extra_info"]["question"]) == "test" for r in test)


def test_difficulty_bounds_steps_numbers_and_ops():
    easy = wp.Difficulty(min_steps=2, max_steps=2, max_number=9, max_result=18)
    for rec in wp.generate(300, seed=0, difficulty=easy):
        solution = rec["extra_info"]["answer"]
        assert solution.count("\n") == 2  # two steps, then the answer line
        numbers = [int(x) for x in re.findall(r"\d+", solution)]
        assert all(0 <= x <= 18 for x in numbers)
        assert "*" not in solution
    hard = wp.Difficulty(min_steps=3, max_steps=3, ops=("add", "sub", "mul"))
    recs = wp.generate(300, seed=0, difficulty=hard)
    assert any("*" in r["extra_info"]["answer"] for r in recs)
    for rec in recs:
        _check_solution(rec["extra_info"]["answer"], rec["reward_model"]["ground_truth"])
    with pytest.raises(ValueError, match="min_steps"):
        wp.generate(1, difficulty=wp.Difficulty(min_steps=3, max_steps=2))
    with pytest.raises(ValueError, match="split"):
        wp.generate(1, split="dev")


def test_too_many_problems_for_a_tiny_space_is_an_error():
    tiny = wp.Difficulty(min_steps=1, max_steps=1, max_number=2, max_result=4)
    with pytest.raises(ValueError, match="distinct"):
        wp.generate(20_000, seed=0, difficulty=tiny)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_write_dataset_reads_back_through_the_data_sources(tmp_path, fmt):
    train_path, test_path = wp.write_dataset(tmp_path, 40, 10, seed=5, fmt=fmt)
    assert (train_path.name, test_path.name) == (f"train.{fmt}", f"test.{fmt}")
    assert load_records(str(train_path)) == wp.generate(40, seed=5, split="train")
    assert load_records(str(test_path)) == wp.generate(10, seed=5, split="test")

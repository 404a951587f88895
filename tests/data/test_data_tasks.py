"""Built-in synthetic tasks: deterministic prompts, exact graded rewards, SFT examples."""

from __future__ import annotations

import pytest

from hybridflow.data import TASKS, get_task
from hybridflow.data.tasks import (
    copy_reward,
    last_digit_reward,
    parity_reward,
    word_problems_reward,
)


def _score(fn, prompts, responses, metadata=None):
    metadata = metadata if metadata is not None else [{} for _ in prompts]
    return fn(prompts, responses, [[] for _ in prompts], [[] for _ in prompts], metadata)


def test_prompts_are_deterministic_per_seed():
    for task in TASKS.values():
        a, b, c = task.prompts(20, seed=1), task.prompts(20, seed=1), task.prompts(20, seed=2)
        assert a == b and a != c
        assert len({r["id"] for r in a}) == 20
        for rec in a:  # the recorded answer is what the exact rule expects
            if task.answer_in_prompt:
                assert task.answer_for(rec["prompt"], {}, 0) == rec["answer"]
            assert task.answer_for(rec["prompt"], {"answer": rec["answer"]}, 0) == rec["answer"]
            assert task.score(rec["answer"], rec["answer"]) == 1.0
        sft = task.sft_examples(5, seed=1)
        assert [e["prompt"] for e in sft] == [r["prompt"] for r in a[:5]]
        assert [e["response"] for e in sft] == [r["answer"] for r in a[:5]]


def test_last_digit_rewards_are_exact_and_graded():
    p = "last:40719="
    got = _score(last_digit_reward, [p] * 7, ["9", " 9", "9 3", "95", "3", "x9", ""])
    assert got == pytest.approx([1.0, 1.0, 0.8, 0.8, 0.5, 0.0, 0.0])
    # Metadata's answer wins over the prompt (here they disagree on purpose).
    assert _score(last_digit_reward, [p], ["5"], [{"answer": "5"}]) == [1.0]


def test_copy_and_parity_rewards():
    got = _score(copy_reward, ["copy:472="] * 5, ["472", "4 7 2", "47", "479", "x"])
    assert got == pytest.approx([1.0, 1.0, 0.8 * 2 / 3, 0.8 * 2 / 3, 0.0])
    got = _score(parity_reward, ["parity:1011="] * 5, ["odd", " odd", "odd odd", "even", "x"])
    assert got == pytest.approx([1.0, 1.0, 0.7, 0.2, 0.0])
    assert _score(parity_reward, ["parity:1001="], ["even"]) == [1.0]


def test_answer_is_parsed_through_a_chat_template_and_missing_answer_raises():
    wrapped = "<|user|>\nlast:123=<|assistant|>\n"
    assert _score(last_digit_reward, [wrapped], ["3"]) == [1.0]
    with pytest.raises(ValueError, match="sample 1 has no 'answer'"):
        _score(last_digit_reward, ["last:1=", "hello"], ["1", "1"])
    with pytest.raises(ValueError, match="must match"):
        last_digit_reward(["last:1="], [], [], [], [])
    with pytest.raises(KeyError, match="known"):
        get_task("sorting")


def test_word_problems_prompts_are_gsm8k_shaped_and_scored_after_the_marker():
    recs = get_task("word_problems").prompts(50, seed=0)
    assert all(100 <= len(r["prompt"]) <= 260 and r["prompt"].endswith('"####".') for r in recs)
    ans = recs[0]["answer"]
    meta = [{"answer": ans}] * 4
    got = _score(
        word_problems_reward,
        [recs[0]["prompt"]] * 4,
        [f"3+4=7\n#### {ans}", f"#### {ans}.", f"#### {int(ans) + 1}", "no marker, no number"],
        meta,
    )
    assert got == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="no 'answer'"):
        _score(word_problems_reward, [recs[0]["prompt"]], ["1"])

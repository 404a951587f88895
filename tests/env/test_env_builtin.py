"""Built-in environments: the calculator (safe arithmetic, gsm8k reward through ToolEnv)
and guess-the-number (feedback turns, reward only at the end)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from hybridflow.data.word_problems import generate
from hybridflow.errors import ConfigError
from hybridflow.stages.env.builtin.calculator import MAX_CHARS, CalculatorEnv, calc, evaluate
from hybridflow.stages.env.builtin.guess_number import (
    DATA_SOURCE,
    GuessNumberEnv,
    make_records,
)
from hybridflow.stages.env.protocol import Action, EnvError, ObservationKind, call
from hybridflow.stages.env.registry import make_env_factory

# --- calc ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("3*4", "12"),
        ("(7 + 5) * 3 - 4 / 8", "35.5"),
        ("-(2 - 5)", "3"),
        ("+4 - -2", "6"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.333333"),
        ("0.1 + 0.2", "0.3"),
        ("10 / 4 * 2", "5"),
        ("  12  ", "12"),
        ("2 - 2 * 3", "-4"),
    ],
)
def test_calc_arithmetic(expression, expected):
    assert calc(expression) == expected


def test_calc_is_exact():
    assert evaluate("0.1 + 0.2") == Fraction(3, 10)
    assert evaluate("1/3 * 3") == 1


@pytest.mark.parametrize(
    ("expression", "needle"),
    [
        ("__import__('os')", "not Call"),
        ("__import__('os').system('echo hi')", "not Call"),
        ("open('/etc/passwd')", "not Call"),
        ("x + 1", "not Name"),
        ("(1).__class__", "not Attribute"),
        ("[1, 2][0]", "not Subscript"),
        ("2 ** 10", "not Pow"),
        ("7 // 2", "not FloorDiv"),
        ("7 % 2", "not Mod"),
        ("1 if 1 else 2", "not IfExp"),
        ("lambda: 1", "not Lambda"),
        ("'12'", "only numbers"),
        ("True + 1", "only numbers"),
        ("3j", "only numbers"),
        ("1,234", "not Tuple"),
        ("1 / 0", "division by zero"),
        ("1 / (2 - 2)", "division by zero"),
        ("9" * 16, "beyond"),
        ("99999999 * 99999999", "beyond"),
        ("1e999", "beyond"),
        ("", "empty expression"),
        ("3 +", "not an arithmetic expression"),
        ("1\n+2\nimport os", "not an arithmetic expression"),
        ("1" * (MAX_CHARS + 1), "at most"),
    ],
)
def test_calc_refuses_everything_but_arithmetic(expression, needle):
    with pytest.raises(ValueError, match=needle):
        calc(expression)


def test_deep_nesting_within_the_length_bound_is_fine():
    expr = "(" * 99 + "1" + ")" * 99  # 199 characters
    assert calc(expr) == "1"
    assert calc("+".join(["1"] * 100)) == "100"  # a left-deep chain of 99 additions


# --- the calculator environment ------------------------------------------------------


def tool_call(expression: str) -> str:
    return (
        "<tool_call>"
        + json.dumps({"name": "calc", "arguments": {"expression": expression}})
        + "</tool_call>"
    )


async def test_calculator_env_on_a_word_problem():
    record = generate(1, seed=3, split="train")[0]
    record = {k: v for k, v in record.items() if k != "prompt"}  # the metadata a rollout sees
    answer = record["reward_model"]["ground_truth"]
    env = make_env_factory("calculator", {"max_turns": 3})()
    assert [s["function"]["name"] for s in env.tools_schema()] == ["calc"]
    await call(env.reset, record)
    r = await call(env.step, Action(f"Let me check. {tool_call(answer + ' * 1')}"))
    assert r.observation.messages == ({"role": "tool", "name": "calc", "content": answer},)
    r = await call(env.step, Action(f"{tool_call('__import__(1)')}"))
    assert r.info["tool_errors"] == 1
    assert (
        "only numbers, + - * / and parentheses are allowed" in r.observation.messages[0]["content"]
    )
    r = await call(env.step, Action(f"So the total is {answer}.\n#### {answer}"))
    assert r.done and r.reward == 1.0 and r.info["acc"] == 1.0 and r.info["pred"] == answer


async def test_calculator_env_wrong_answer_scores_zero():
    env = CalculatorEnv()
    await call(env.reset, {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "9"}})
    r = await call(env.step, Action("#### 8"))
    assert r.done and r.reward == 0.0 and r.info["pred"] == "8"


def test_calculator_env_options_are_checked_by_name():
    with pytest.raises(ConfigError, match="did you mean 'max_turns'") as exc:
        make_env_factory("calculator", {"max_turn": 3}, path="rollout")
    assert exc.value.path == "rollout.env_options.max_turn"


# --- guess the number ---------------------------------------------------------------


def test_records_are_seeded_and_in_range():
    a = make_records(50, seed=7, low=1, high=20, max_turns=5)
    assert a == make_records(50, seed=7, low=1, high=20, max_turns=5)
    assert a != make_records(50, seed=8, low=1, high=20, max_turns=5)
    secrets = [int(r["reward_model"]["ground_truth"]) for r in a]
    assert all(1 <= s <= 20 for s in secrets) and len(set(secrets)) > 5
    assert a[3]["data_source"] == DATA_SOURCE and a[3]["extra_info"]["index"] == 3
    assert "from 1 to 20" in a[0]["prompt"][0]["content"]


def game(secret: int, **options) -> GuessNumberEnv:
    env = GuessNumberEnv(**options)
    obs = env.reset({"reward_model": {"ground_truth": str(secret)}, "extra_info": {}})
    assert obs.kind is ObservationKind.EMPTY
    return env


def test_guess_transitions_and_end_only_reward():
    env = game(37, low=1, high=100, max_turns=7)
    r = env.step(Action("I guess 50"))
    assert (r.done, r.reward) == (False, 0.0)
    assert r.observation.messages == ({"role": "user", "content": "Lower. 6 guesses left."},)
    r = env.step(Action("25"))
    assert r.observation.messages[0]["content"] == "Higher. 5 guesses left."
    r = env.step(Action("maybe thirty?"))
    assert r.info["invalid_guess"] == 1 and not r.done
    assert (
        r.observation.messages[0]["content"]
        == "Answer with one integer from 1 to 100. 4 guesses left."
    )
    r = env.step(Action("500"))  # out of range: invalid too
    assert r.info["invalid_guess"] == 1
    r = env.step(Action("between 30 and 40: 37"))  # the last integer is the guess
    assert r.done and r.reward == 1.0 and r.info["won"] == 1
    assert r.observation.kind is ObservationKind.EMPTY


def test_losing_scores_zero_and_ends_at_max_turns():
    env = game(3, low=1, high=10, max_turns=2)
    assert not env.step(Action("5")).done
    r = env.step(Action("4"))
    assert r.done and r.reward == 0.0 and r.info["won"] == 0
    assert env.turns == 2


def test_turn_bonus_prefers_fewer_guesses():
    first = game(5, high=10, max_turns=5, turn_bonus=0.4)
    assert first.step(Action("5")).reward == 1.0
    last = game(5, high=10, max_turns=5, turn_bonus=0.4)
    for g in ("1", "2", "3", "4"):
        assert last.step(Action(g)).reward == 0.0
    assert last.step(Action("5")).reward == pytest.approx(0.6)


async def test_binary_search_wins_every_record():
    for rec in make_records(20, seed=1):
        env = make_env_factory("guess_number")()
        await call(env.reset, rec)
        lo, hi = 1, 100
        while True:
            g = (lo + hi) // 2
            r = await call(env.step, Action(str(g)))
            if r.done:
                break
            if r.observation.messages[0]["content"].startswith("Higher"):
                lo = g + 1
            else:
                hi = g - 1
        assert r.reward == 1.0, rec


def test_record_range_overrides_options_and_bad_records_are_named():
    env = GuessNumberEnv(high=100)
    env.reset(
        {"reward_model": {"ground_truth": "3"}, "extra_info": {"low": 1, "high": 4, "max_turns": 2}}
    )
    assert (env.high, env.max_turns) == (4, 2)
    assert env.step(Action("9")).info["invalid_guess"] == 1  # 9 is outside 1..4
    with pytest.raises(EnvError, match="outside"):
        GuessNumberEnv(high=10).reset({"reward_model": {"ground_truth": "11"}})
    with pytest.raises(EnvError, match=r"integer reward_model\.ground_truth"):
        GuessNumberEnv().reset({"reward_model": {"ground_truth": "seven"}})
    with pytest.raises(EnvError, match="before reset"):
        GuessNumberEnv().step(Action("1"))

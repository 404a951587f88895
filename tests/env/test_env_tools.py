"""Tools from typed functions (schemas), bounded never-raising calls, and ToolEnv: tool
errors become observations the model reads, never exceptions."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from hybridflow.errors import ConfigError
from hybridflow.stages.env.protocol import Action, EnvError, ObservationKind, call
from hybridflow.stages.env.tool_env import ToolEnv
from hybridflow.stages.env.tools import ErrorKind, Tool, check_arguments, render_result


def add(a: int, b: float = 1.5, label: str | None = None) -> float:
    """Add two numbers.

    Args:
        a: The first addend.
        b: The second addend.
        label: An optional name for the sum.
    """
    return a + b


async def lookup(key: str, keys: list[str]) -> dict:
    """Find a key.

    Args:
        key: What to find.
        keys: Where to look.
    """
    await asyncio.sleep(0)
    return {"found": key in keys}


def explode(x: int) -> str:
    """Always fails.

    Args:
        x: Ignored.
    """
    raise RuntimeError(f"boom {x}")


def make_hang() -> tuple:
    """A sync tool that blocks until its event is set (set it at the end of the test)."""
    release = threading.Event()

    def hang(x: int) -> str:
        """Blocks until released.

        Args:
            x: Ignored.
        """
        release.wait(10)
        return "late"

    return hang, release


async def ahang(x: int) -> str:
    """Sleeps for a long time.

    Args:
        x: Ignored.
    """
    await asyncio.sleep(10)
    return "late"


def no_hints(x):
    """Untyped.

    Args:
        x: anything
    """


def score(data_source, solution_str, ground_truth, extra_info=None):
    return {
        "score": float(solution_str.strip().endswith(str(ground_truth))),
        "pred": solution_str[-3:],
    }


def broken_score(data_source, solution_str, ground_truth, extra_info=None):
    raise ZeroDivisionError("verifier bug")


def call_text(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


RECORD = {"data_source": "test", "reward_model": {"ground_truth": "42"}, "extra_info": {}}


# --- schemas ------------------------------------------------------------------------


def test_schema_is_derived_from_hints_and_docstring():
    tool = Tool.from_function(add)
    assert tool.name == "add"
    fn = tool.schema["function"]
    assert tool.schema["type"] == "function"
    assert fn["description"] == "Add two numbers."
    props = fn["parameters"]["properties"]
    assert props["a"] == {"type": "integer", "description": "The first addend."}
    assert props["b"]["type"] == "number"
    assert props["label"]["type"] == "string" and props["label"].get("nullable") is True
    assert fn["parameters"]["required"] == ["a"]
    assert "return" not in fn  # OpenAI's format has none
    async_schema = Tool.from_function(lookup).schema["function"]["parameters"]
    assert async_schema["properties"]["keys"] == {
        "type": "array",
        "items": {"type": "string"},
        "description": "Where to look.",
    }


def test_a_function_without_hints_is_a_config_error():
    with pytest.raises(ConfigError, match="missing a type hint") as exc:
        Tool.from_function(no_hints, "env_options.tools[0]")
    assert exc.value.path == "env_options.tools[0]"


def test_argument_checks():
    params = Tool.from_function(add).parameters
    assert check_arguments(params, {"a": 1}) == ""
    assert check_arguments(params, {"a": 1, "b": 2, "label": None}) == ""
    assert "missing required argument(s) ['a']" in check_arguments(params, {"b": 2.0})
    assert "unknown argument(s) ['c']" in check_arguments(params, {"a": 1, "c": 0})
    assert check_arguments(params, {"a": 1, "c": 0}, open_ended=True) == ""
    assert "'a' must be integer, got string" in check_arguments(params, {"a": "1"})
    assert "'a' must be integer, got boolean" in check_arguments(params, {"a": True})
    assert "'a' must be integer, got number" in check_arguments(params, {"a": 1.5})
    assert "'b' must be number, got string" in check_arguments(params, {"a": 1, "b": "x"})
    assert "must be one of" in check_arguments(
        {"properties": {"m": {"type": "string", "enum": ["a", "b"]}}}, {"m": "c"}
    )


def test_render_result():
    assert render_result("12", 100) == "12"
    assert render_result({"x": [1, 2]}, 100) == '{"x": [1, 2]}'
    assert render_result(float("nan"), 100) == "nan"  # not JSON: str()
    cut = render_result("z" * 50, 20)
    assert len(cut) == 20 and cut.endswith("...(truncated)")


# --- invoke: every failure is an outcome ------------------------------------------


async def test_invoke_sync_and_async_tools():
    out = await Tool.from_function(add).invoke({"a": 2, "b": 0.5}, timeout_s=5)
    assert out.ok and out.content == "2.5" and out.name == "add"
    out = await Tool.from_function(lookup).invoke({"key": "k", "keys": ["k"]}, timeout_s=5)
    assert out.ok and out.content == '{"found": true}'


async def test_invoke_turns_failures_into_outcomes():
    out = await Tool.from_function(explode).invoke({"x": 3}, timeout_s=5)
    assert out.error is ErrorKind.RAISED and "RuntimeError: boom 3" in out.content
    out = await Tool.from_function(add).invoke({"a": "two"}, timeout_s=5)
    assert out.error is ErrorKind.BAD_ARGUMENTS and "'a' must be integer" in out.content
    hang, release = make_hang()
    t0 = time.perf_counter()
    out = await Tool.from_function(hang).invoke({"x": 1}, timeout_s=0.05)
    assert out.error is ErrorKind.TIMEOUT and "timed out after 0.05 s" in out.content
    out = await Tool.from_function(ahang).invoke({"x": 1}, timeout_s=0.05)
    assert out.error is ErrorKind.TIMEOUT
    assert time.perf_counter() - t0 < 3.0
    release.set()


# --- ToolEnv ------------------------------------------------------------------------


def make_env(**kw) -> ToolEnv:
    kw.setdefault("reward", score)
    hang, _ = make_hang()
    return ToolEnv([add, lookup, explode, hang], **kw)


async def test_tool_env_runs_calls_and_ends_on_a_turn_without_one():
    env = make_env()
    assert [s["function"]["name"] for s in env.tools_schema()] == [
        "add",
        "lookup",
        "explode",
        "hang",
    ]
    assert (await call(env.reset, RECORD)).kind is ObservationKind.EMPTY
    r1 = await call(env.step, Action("I add.\n" + call_text("add", a=40, b=2)))
    assert not r1.done and r1.reward == 0.0
    assert r1.observation.messages == ({"role": "tool", "name": "add", "content": "42"},)
    assert (r1.info["tool_calls"], r1.info["tool_errors"]) == (1, 0)
    r2 = await call(env.step, Action("So the answer is 42"))
    assert r2.done and r2.reward == 1.0
    assert r2.observation.kind is ObservationKind.EMPTY
    assert r2.info["pred"] == " 42" and r2.info["reward_failures"] == 0
    assert r2.info["max_turns_reached"] == 0 and r2.info["tool_calls"] == 0


async def test_every_kind_of_tool_error_is_an_observation():
    hang, release = make_hang()
    env = ToolEnv(
        [add, lookup, explode, hang], reward=score, tool_timeout_s=0.05, max_calls_per_turn=5
    )
    await call(env.reset, RECORD)
    turn = (
        call_text("add", a=1)
        + call_text("nope", a=1)
        + "<tool_call>{broken</tool_call>"
        + call_text("add", a="x")
        + call_text("explode", x=1)
    )
    r = await call(env.step, Action(turn))
    assert not r.done
    contents = [m["content"] for m in r.observation.messages]
    assert contents[0] == "2.5"
    assert "unknown tool 'nope'; tools: add, explode, hang, lookup" in contents[1]
    assert "not valid JSON" in contents[2]
    assert "'a' must be integer" in contents[3]
    assert "RuntimeError: boom 1" in contents[4]
    assert all(m["role"] == "tool" for m in r.observation.messages)
    assert "name" not in r.observation.messages[2]  # a malformed call has no name
    assert (r.info["tool_calls"], r.info["tool_errors"]) == (5, 4)
    r = await call(env.step, Action(call_text("hang", x=0)))
    assert "timed out" in r.observation.messages[0]["content"] and r.info["tool_errors"] == 1
    r = await call(env.step, Action(call_text("add", a=1) * 6))
    assert "more than 5 tool calls" in r.observation.messages[5]["content"]
    release.set()


async def test_calls_of_one_turn_run_concurrently():
    def slow(x: int) -> int:
        """Sleeps.

        Args:
            x: returned
        """
        time.sleep(0.3)
        return x

    env = ToolEnv([slow], max_calls_per_turn=4)
    await call(env.reset, RECORD)
    t0 = time.perf_counter()
    r = await call(env.step, Action("".join(call_text("slow", x=i) for i in range(4))))
    assert [m["content"] for m in r.observation.messages] == ["0", "1", "2", "3"]
    assert time.perf_counter() - t0 < 1.0  # one after another: 1.2 s


async def test_max_turns_ends_the_trajectory_and_is_counted():
    env = make_env(max_turns=2)
    await call(env.reset, RECORD)
    r1 = await call(env.step, Action(call_text("add", a=1)))
    assert not r1.done
    r2 = await call(env.step, Action(call_text("add", a=2) + " 42"))
    assert r2.done and r2.info["max_turns_reached"] == 1
    assert r2.reward == 1.0  # a trajectory the limit cut is still scored (its text ends in 42)
    assert env.turns == 2


async def test_a_truncated_turn_ends_the_trajectory():
    env = make_env()
    await call(env.reset, RECORD)
    r = await call(env.step, Action(call_text("add", a=1), truncated=True))
    assert r.done and r.info["max_turns_reached"] == 0


async def test_reward_sees_every_model_turn_joined():
    seen = {}

    def capture(data_source, solution_str, ground_truth, extra_info=None):
        seen.update(ds=data_source, text=solution_str, gt=ground_truth, extra=extra_info)
        return 0.5

    env = ToolEnv([add], reward=capture)
    await call(env.reset, {**RECORD, "extra_info": {"split": "test"}})
    await call(env.step, Action("first " + call_text("add", a=1)))
    r = await call(env.step, Action("second"))
    assert r.reward == 0.5
    assert seen == {
        "ds": "test",
        "text": "first " + call_text("add", a=1) + "\nsecond",
        "gt": "42",
        "extra": {"split": "test"},
    }


async def test_a_failing_reward_is_a_counted_fallback():
    env = ToolEnv([add], reward=broken_score, failure_score=-1.0)
    await call(env.reset, RECORD)
    r = await call(env.step, Action("no call"))
    assert r.done and r.reward == -1.0 and r.info["reward_failures"] == 1


def test_tool_env_configuration_errors():
    with pytest.raises(ConfigError, match="share the name"):
        ToolEnv([add, add])
    with pytest.raises(ConfigError, match="per-sample arguments"):
        ToolEnv([add], reward=lambda x: 0.0)
    with pytest.raises(ConfigError, match="unknown scorer"):
        ToolEnv([add], reward="gsm9k")
    with pytest.raises(ConfigError, match="did you mean 'hermes'"):
        ToolEnv([add], parser="herms")
    env = ToolEnv([f"{__name__}:add"], reward=f"{__name__}:score")
    assert list(env.tools) == ["add"] and env.reward is score


async def test_reset_needs_the_ground_truth_when_a_reward_is_set():
    env = make_env()
    with pytest.raises(EnvError, match=r"has no 'reward_model\.ground_truth'"):
        env.reset({"data_source": "x"})
    ToolEnv([add]).reset({"data_source": "x"})  # no reward: no ground truth needed

"""ToolEnv: an environment whose actions are tool calls and whose last turn is the answer.

    env = ToolEnv(tools=[calc], reward="gsm8k", max_turns=4)
    env.tools_schema()          # -> the chat template's `tools=` (OpenAI function schemas)
    await call(env.reset, record)
    result = await call(env.step, Action(text=turn_text, token_ids=turn_ids))

One step, for one model turn:

    parse the turn (parser: hermes)
      no tool call, a truncated turn, or the max_turns-th turn
          -> done; reward = reward(data_source, solution_str, ground_truth, extra_info)
             where solution_str is every model turn of the trajectory joined by "\\n"
      else run the calls concurrently, each bounded by tool_timeout_s
          -> observation: one {"role": "tool", "name": ..., "content": ...} message per
             call, in the order of the calls; reward 0.0; not done

`info` per step counts `tool_calls` (calls the model made on a turn that runs them,
rejected ones included; 0 on the done step, whose calls are not run), `tool_errors` (a
malformed call, an unknown tool, arguments that do not fit the schema, a tool that
raised or timed out, a call past `max_calls_per_turn`: each is a tool message saying
what went wrong, never an exception) and `tool_s` (seconds in tools). The done step adds `max_turns_reached` (1
when the turn limit, not the model, ended it), the reward's extras (`acc`, `pred`, ...)
and `reward_failures`.

The reward is verl's per-sample `compute_score(data_source, solution_str, ground_truth,
extra_info=None) -> float | {"score": ...}`: a callable, a `package.module:function`, or
a built-in scorer's name (hybridflow.reward.scorers: gsm8k, math, countdown, default).
A reward call that raises, times out (reward_timeout_s) or returns a bad value gives
`failure_score` and counts one `reward_failures`, like the function reward backend.
Without a reward, every step's reward is 0.0 (a reward stage scores the trajectory).

Invariants: a ToolEnv is one trajectory's state (build one per trajectory); `step`
never raises for what the model wrote (only EnvStuckError, when a tool or the reward
hangs on call after call); `reset` raises EnvError when a reward needs a ground truth
and the record has none.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from hybridflow.config.imports import load_attr
from hybridflow.errors import ConfigError, EnvStuckError
from hybridflow.reward.values import split_result
from hybridflow.stages.env.parsers import ParseError, ToolCall, get_parser
from hybridflow.stages.env.protocol import (
    Action,
    EnvError,
    InfoValue,
    Message,
    Observation,
    StepResult,
    call,
)
from hybridflow.stages.env.tools import ErrorKind, Tool, ToolOutcome
from hybridflow.stages.reward.per_sample import is_per_sample, takes_extra_info

__all__ = ["ToolEnv", "load_reward", "load_tools"]

log = logging.getLogger("hybridflow.env.tool_env")

RewardFn = Callable[..., Any]


def load_tools(tools: Sequence[Callable[..., Any] | Tool | str], path: str = "tools") -> list[Tool]:
    """Callables, Tools or `package.module:function` strings -> Tools with unique names."""
    out: list[Tool] = []
    for i, t in enumerate(tools):
        where = f"{path}[{i}]"
        if isinstance(t, Tool):
            out.append(t)
            continue
        fn = (
            load_attr(t, where, callable_only=True, form="package.module:function")
            if isinstance(t, str)
            else t
        )
        if not callable(fn):
            raise ConfigError(where, f"a tool must be a function, got {type(fn).__name__}")
        out.append(Tool.from_function(fn, where))
    names = [t.name for t in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(path, f"two tools share the name(s) {dup}")
    return out


def load_reward(reward: RewardFn | str | None, path: str = "reward") -> RewardFn | None:
    """A verl-signature reward function from a callable, `package.module:function` or a
    built-in scorer name; ConfigError when it does not take verl's arguments."""
    if reward is None:
        return None
    fn: Any = reward
    if isinstance(reward, str):
        if ":" not in reward:
            from hybridflow.reward.scorers import scorer_target

            reward = scorer_target(reward, path)
        fn = load_attr(reward, path, callable_only=True, form="package.module:function")
    if not callable(fn) or not is_per_sample(fn):
        raise ConfigError(
            path,
            f"{fn!r} must take verl's per-sample arguments "
            "(data_source, solution_str, ground_truth, extra_info=None)",
        )
    return fn  # type: ignore[no-any-return]


class ToolEnv:
    def __init__(
        self,
        tools: Sequence[Callable[..., Any] | Tool | str],
        *,
        reward: RewardFn | str | None = None,
        max_turns: int = 4,
        parser: str = "hermes",
        max_calls_per_turn: int = 4,
        tool_timeout_s: float = 10.0,
        max_result_chars: int = 2000,
        reward_timeout_s: float = 30.0,
        failure_score: float = 0.0,
        ground_truth_key: str = "reward_model.ground_truth",
    ) -> None:
        if max_turns < 1:
            raise ConfigError("env_options.max_turns", f"must be >= 1, got {max_turns}")
        for key, value in (
            ("tool_timeout_s", tool_timeout_s),
            ("reward_timeout_s", reward_timeout_s),
        ):
            if not 0 < value < float("inf"):
                raise ConfigError(f"env_options.{key}", f"must be > 0 seconds, got {value}")
        self.tools = {t.name: t for t in load_tools(tools, "env_options.tools")}
        self.reward = load_reward(reward, "env_options.reward")
        if max_calls_per_turn < 1:
            raise ConfigError(
                "env_options.max_calls_per_turn", f"must be >= 1, got {max_calls_per_turn}"
            )
        self.parser = get_parser(parser, "env_options.parser")
        self.max_calls_per_turn = max_calls_per_turn
        self.max_turns = max_turns
        self.tool_timeout_s, self.reward_timeout_s = tool_timeout_s, reward_timeout_s
        self.max_result_chars = max_result_chars
        self.failure_score = float(failure_score)
        self.ground_truth_key = ground_truth_key
        self._schema = [t.schema for t in self.tools.values()]
        self._record: dict[str, Any] = {}
        self._texts: list[str] = []

    def tools_schema(self) -> list[dict[str, Any]]:
        """The OpenAI function schemas, for the chat template's `tools=`."""
        return [dict(s) for s in self._schema]

    @property
    def turns(self) -> int:
        return len(self._texts)

    def reset(self, record: dict[str, Any]) -> Observation:
        self._record = dict(record)
        self._texts = []
        if self.reward is not None:
            self._ground_truth()  # a record without one is a data error, named now
        return Observation.empty()

    async def step(self, action: Action) -> StepResult:
        self._texts.append(action.text)
        turn = self.parser.parse(action.text)
        info: dict[str, InfoValue] = {"tool_calls": len(turn.items), "tool_errors": 0}
        last = self.turns >= self.max_turns
        if not turn.attempted or action.truncated or last:
            # calls in a turn that ends the trajectory are not run (nothing would read them)
            info["tool_calls"] = 0
            info["max_turns_reached"] = int(last and turn.attempted and not action.truncated)
            reward, extras = await self._score()
            info.update(extras)
            return StepResult(Observation.empty(), reward, done=True, info=info)
        items = list(turn.items)
        for k in range(self.max_calls_per_turn, len(items)):  # past the limit: not run
            items[k] = ParseError(f"more than {self.max_calls_per_turn} tool calls in one turn")
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(self._run(item) for item in items))
        info["tool_s"] = time.perf_counter() - t0
        info["tool_errors"] = sum(not o.ok for o in outcomes)
        messages: list[Message] = []
        for o in outcomes:
            m: Message = {"role": "tool", "content": o.content}
            if o.name:
                m["name"] = o.name
            messages.append(m)
        return StepResult(Observation.from_messages(messages), 0.0, done=False, info=info)

    async def _run(self, item: ToolCall | ParseError) -> ToolOutcome:
        if isinstance(item, ParseError):
            return ToolOutcome("", f"Error: {item.message()}", ErrorKind.PARSE)
        tool = self.tools.get(item.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolOutcome(
                item.name,
                f"Error: unknown tool {item.name!r}; tools: {known}",
                ErrorKind.UNKNOWN_TOOL,
            )
        return await tool.invoke(
            item.arguments, timeout_s=self.tool_timeout_s, max_chars=self.max_result_chars
        )

    def _ground_truth(self) -> Any:
        value: Any = self._record
        for part in self.ground_truth_key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise EnvError(
                    f"ToolEnv.reset: the record (fields {sorted(self._record)}) has no "
                    f"{self.ground_truth_key!r}; set env_options.ground_truth_key to where "
                    "the record keeps the answer",
                    what="ToolEnv.reset",
                )
            value = value[part]
        return value

    async def _score(self) -> tuple[float, dict[str, InfoValue]]:
        if self.reward is None:
            return 0.0, {}
        kwargs: dict[str, Any] = {
            "data_source": self._record.get("data_source", ""),
            "solution_str": "\n".join(self._texts),
            "ground_truth": self._ground_truth(),
        }
        if takes_extra_info(self.reward):
            kwargs["extra_info"] = self._record.get("extra_info") or {}
        name = getattr(self.reward, "__name__", "reward")
        try:
            value = await call(
                functools.partial(self.reward, **kwargs),
                timeout_s=self.reward_timeout_s,
                what=f"reward {name}",
                setting="env_options.reward_timeout_s",
            )
            score, extras = split_result(value)
        except EnvStuckError:
            raise  # a reward that hangs on every input is broken: stop, do not score 0
        except Exception as exc:  # raised, timed out (EnvTimeout), bad value (BadReward): logged
            log.warning(
                "ToolEnv reward %s failed (%s: %s); reward %s",
                name,
                type(exc).__name__,
                exc,
                self.failure_score,
            )
            return self.failure_score, {"reward_failures": 1}
        return score, {**extras, "reward_failures": 0}

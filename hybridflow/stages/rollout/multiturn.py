"""The trajectory loop: multi-turn rollouts, shared by the rollout backends.

A backend hands the loop its single-turn primitive as a `TurnEngine` ("continue these
token rows by one model turn each"); the loop drives it turn by turn and calls the
environment directly, in this process, so per-turn traffic never crosses the
coordinator. One `generate` call (one micro-batch) is one `TrajectoryLoop.run`:

    for each row, concurrently:  env = factory(); first = reset(record)
        prompt = the row's prompt (first is EMPTY) | first's messages templated | its ids
    turn k = 0, 1, ...  (every live trajectory in one engine call: turn-synchronous)
        limit_i = min(max_new_tokens, budget - context_i)      budget: max_total_tokens
        out_i   = engine.generate(context_i, limit_i)         seeded (seed, step, mb, k)
        concurrently (at most env_concurrency calls):  res_i = env_i.step(out_i)
        a trajectory ends: res.done | its max_turns-th turn | no budget for the
                           observation plus one token; else context_i += out_i + obs_i
    close every env; layouts -> collate (what single-turn generate returns, + env_reward)

Token-in/token-out: turn k+1's input ids are exactly turn k's input ids, plus the ids
the engine generated, plus the observation's ids (stages/env/observations.py). Nothing
already in a context is ever decoded and re-tokenized.

Turn-synchronous on purpose: the set of trajectories that share turn k's engine call,
and their order, depend only on the trajectories themselves, so a seeded run repeats
exactly (each turn's generator is seeded from the call's seed and k). The price: turn
k+1 starts when turn k's slowest environment step returns (bounded by env_timeout_s).
An engine that keeps a trajectory's KV between turns receives `TurnRequest.appended`:
only the last `appended` ids of the context are new since its previous turn.

Errors: an environment whose reset/step/close raises or runs past `env_timeout_s` stops
the micro-batch with an EnvError naming the call, the row, the turn and the bound (a
model's mistake inside a tool is the environment's to turn into an observation,
ToolEnv does). Nothing hangs: every environment call is bounded.

Metrics (per generate call; the coordinator averages micro-batches):
  rollout/turns/mean        model turns per trajectory
  rollout/tool_calls        tool calls per trajectory (the env's `tool_calls` info)
  rollout/tool_errors       failed tool calls per trajectory (`tool_errors`)
  rollout/obs_token_frac    observation tokens / response tokens
  rollout/truncated_frac    trajectories the loop's limits ended (not the environment)
  rollout/env_reward/mean   mean env_reward
  rollout/context_tokens    context tokens of every turn's request (what an engine that
                            re-prefills each turn prefills: the hf backend)
  rollout/appended_tokens   the new part of those contexts (what a KV-keeping engine needs)
  env/step_s                mean seconds of one env.step call; env/wait_s: seconds the
                            loop waited on environment calls
  env/<key>                 per trajectory, the sum of any other numeric `info` entry
                            (won, invalid_guess, tool_s, reward_failures, ...)

Invariants: every trajectory has at least one model turn; a layout ends on a model
token; `env_reward` is the sum of a trajectory's step rewards (its final reward for the
end-only environments of stages/env/builtin), finite float32 (StepResult checks each).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hybridflow.data.batching import pad_left
from hybridflow.errors import BatchError, ConfigError
from hybridflow.stages.env.layout import ResponseLayout, Trajectory, collate
from hybridflow.stages.env.observations import ObservationEncoder
from hybridflow.stages.env.protocol import (
    Action,
    EnvError,
    Environment,
    EnvTimeout,
    Observation,
    ObservationKind,
    StepResult,
    call,
    close_env,
)
from hybridflow.stages.env.registry import make_env_factory

__all__ = [
    "LoopResult",
    "MultiTurnConfig",
    "TrajectoryLoop",
    "TurnEngine",
    "TurnOutput",
    "TurnRequest",
]

_SETTING = "env_timeout_s"
# info keys reported under rollout/ (the names issue 23 promises), the others under env/
_ROLLOUT_COUNTERS = {"tool_calls": "rollout/tool_calls", "tool_errors": "rollout/tool_errors"}


@dataclass(frozen=True)
class TurnRequest:
    """Continue trajectory `key` by one model turn of at most `max_new_tokens` tokens.
    `context_ids` is the whole context; its last `appended` ids are new since the
    trajectory's previous turn (all of them on its first turn)."""

    key: int
    context_ids: list[int]
    appended: int
    max_new_tokens: int


@dataclass(frozen=True)
class TurnOutput:
    ids: list[int]  # the generated ids (the stop token included when it stopped)
    logprobs: list[float]  # the sampler's log-prob of each
    stopped: bool  # ended on a stop token (False: cut at its max_new_tokens)


class TurnEngine(Protocol):
    """A backend's single-turn primitive. `generate` answers every request, in order;
    `turn` is the loop's turn index (the engine seeds its sampling from it)."""

    async def generate(self, requests: Sequence[TurnRequest], turn: int) -> list[TurnOutput]: ...


@dataclass(frozen=True)
class MultiTurnConfig:
    """The loop's settings: the rollout options of the same names (state.py)."""

    env: str
    env_options: Mapping[str, Any]
    max_turns: int
    max_total_tokens: int  # 0: the model's positions only
    env_timeout_s: float
    env_concurrency: int
    tool_parser: str  # "": the environment's own

    @classmethod
    def of(cls, opts: Any) -> MultiTurnConfig:
        return cls(
            env=opts.env,
            env_options=dict(opts.env_options),
            max_turns=opts.max_turns,
            max_total_tokens=opts.max_total_tokens,
            env_timeout_s=opts.env_timeout_s,
            env_concurrency=opts.env_concurrency,
            tool_parser=opts.tool_parser,
        )


@dataclass
class _Row:
    """One trajectory while the loop runs it."""

    env: Environment
    traj: Trajectory
    encoder: ObservationEncoder
    reward: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)
    appended: int = 0  # context ids new since the last turn
    done: bool = False
    truncated: bool = False  # ended by the loop's limits, not by the environment


@dataclass(frozen=True)
class LoopResult:
    prompts: list[list[int]]  # each trajectory's prompt ids
    prompt_replaced: bool  # some reset replaced its row's prompt
    layouts: list[ResponseLayout]
    env_reward: list[float]
    metrics: dict[str, float]

    def tensors(self, pad_id: int) -> dict[str, torch.Tensor]:
        """The layouts collated (response_ids/mask, rollout_logprobs, num_turns) and
        env_reward [B] float32; prompt_ids/prompt_mask only when a reset replaced one."""
        out = collate(self.layouts, pad_id)
        out["env_reward"] = torch.tensor(self.env_reward, dtype=torch.float32)  # [B]
        if self.prompt_replaced:
            out["prompt_ids"], out["prompt_mask"] = pad_left(self.prompts, pad_id)  # [B, P]
        return out


class TrajectoryLoop:
    """The loop of one rollout role: its environment factory and observation encoders
    (one per distinct tools schema), built once in the backend's setup."""

    def __init__(
        self,
        cfg: MultiTurnConfig,
        tokenizer: Any,
        stop_token_ids: Sequence[int],
        *,
        position_limit: int | None = None,
        path: str = "",
    ) -> None:
        options = dict(cfg.env_options)
        if cfg.tool_parser:
            options["parser"] = cfg.tool_parser
        self.cfg = cfg
        try:
            self.factory: Callable[[], Environment] = make_env_factory(cfg.env, options, path)
        except ConfigError as exc:
            if not cfg.tool_parser or not exc.path.endswith(".env_options.parser"):
                raise
            key = f"{path}.tool_parser" if path else "tool_parser"
            raise ConfigError(
                key, f"{cfg.env} takes no `parser` option to pass it to ({exc})"
            ) from None
        self.tokenizer = tokenizer
        self.stop_ids = list(stop_token_ids)
        self.budget = min(
            cfg.max_total_tokens or float("inf"), position_limit or float("inf")
        )  # context tokens a trajectory may reach
        self._encoders: dict[str, ObservationEncoder] = {}

    # -- the loop --------------------------------------------------------------------------
    async def run(
        self,
        engine: TurnEngine,
        prompts: Sequence[Sequence[int]],
        records: Sequence[dict[str, Any]],
        max_new_tokens: int,
    ) -> LoopResult:
        """Every row's trajectory to its end (module docstring)."""
        if len(prompts) != len(records):
            raise BatchError(f"multi-turn: {len(prompts)} prompts but {len(records)} records")
        t_env = [0.0]  # seconds waited on environment calls
        step_times: list[float] = []
        envs: list[Environment] = []
        try:
            rows, context, appended = await self._turns(
                engine, prompts, records, max_new_tokens, envs, t_env, step_times
            )
        except BaseException:
            await self._close_all(envs, report=False)  # the first error is the one to see
            raise
        t0 = time.perf_counter()
        await self._close_all(envs)
        t_env[0] += time.perf_counter() - t0
        replaced = any(row.traj.prompt_ids != list(p) for row, p in zip(rows, prompts, strict=True))
        layouts = [row.traj.layout() for row in rows]
        metrics = self._metrics(rows, layouts, step_times, t_env[0])
        metrics["rollout/context_tokens"] = float(context)
        metrics["rollout/appended_tokens"] = float(appended)
        return LoopResult(
            prompts=[row.traj.prompt_ids for row in rows],
            prompt_replaced=replaced,
            layouts=layouts,
            env_reward=[row.reward for row in rows],
            metrics=metrics,
        )

    async def _turns(
        self,
        engine: TurnEngine,
        prompts: Sequence[Sequence[int]],
        records: Sequence[dict[str, Any]],
        max_new_tokens: int,
        envs: list[Environment],
        t_env: list[float],
        step_times: list[float],
    ) -> tuple[list[_Row], int, int]:
        """reset every row, then the turns -> (rows, context tokens, appended tokens)."""
        t0 = time.perf_counter()
        rows = await self._bounded(
            [
                self._start(i, p, r, envs)
                for i, (p, r) in enumerate(zip(prompts, records, strict=True))
            ]
        )
        t_env[0] += time.perf_counter() - t0
        context = appended = 0
        for turn in range(self.cfg.max_turns):
            live = [i for i, row in enumerate(rows) if not row.done]
            requests = self._requests(rows, live, max_new_tokens, turn)
            if not requests:
                break
            context += sum(len(r.context_ids) for r in requests)
            appended += sum(r.appended for r in requests)
            outputs = await engine.generate(requests, turn)
            if len(outputs) != len(requests):
                raise BatchError(
                    f"multi-turn: the engine answered {len(outputs)} of {len(requests)} requests"
                )
            t0 = time.perf_counter()
            results = await self._bounded(
                [
                    self._step(rows[r.key], r.key, turn, out, step_times)
                    for r, out in zip(requests, outputs, strict=True)
                ]
            )
            t_env[0] += time.perf_counter() - t0
            last = turn == self.cfg.max_turns - 1
            for r, out, res in zip(requests, outputs, results, strict=True):
                self._advance(rows[r.key], out, res, last, f"multi-turn row {r.key} turn {turn}")
        return rows, context, appended

    async def _start(
        self, i: int, prompt: Sequence[int], record: dict[str, Any], envs: list[Environment]
    ) -> _Row:
        try:
            env = self.factory()
        except EnvError:
            raise
        except Exception as exc:  # the class's constructor raised: named, with the row
            raise EnvError(
                f"multi-turn row {i}: building the environment {self.cfg.env!r} raised "
                f"{type(exc).__name__}: {exc}",
                what=self.cfg.env,
            ) from exc
        envs.append(env)
        first = await self._env_call(env.reset, dict(record), row=i, turn=-1)
        if not isinstance(first, Observation):
            raise EnvError(
                f"multi-turn row {i}: {type(env).__name__}.reset returned a "
                f"{type(first).__name__}, not an Observation",
                what=f"{type(env).__name__}.reset",
            )
        encoder = self._encoder(env)
        if first.kind is ObservationKind.EMPTY:
            ids = list(prompt)
        elif first.kind is ObservationKind.MESSAGES:
            ids = encoder.prompt_ids(first.messages)
        else:
            ids = encoder.encode(first)  # token ids, checked against the vocabulary
        if not ids:
            raise EnvError(
                f"multi-turn row {i}: {type(env).__name__}.reset left an empty prompt",
                what=f"{type(env).__name__}.reset",
            )
        row = _Row(env=env, traj=Trajectory(ids), encoder=encoder, appended=len(ids))
        return row

    def _requests(
        self, rows: list[_Row], live: list[int], max_new_tokens: int, turn: int
    ) -> list[TurnRequest]:
        out = []
        for i in live:
            row = rows[i]
            room = self.budget - row.traj.total_tokens
            if room < 1:
                if turn == 0:
                    raise BatchError(
                        f"multi-turn row {i}: its prompt of {row.traj.total_tokens} tokens "
                        f"leaves no room within {self._budget_name()} ({self.budget:g})"
                    )
                row.done = row.truncated = True
                continue
            limit = int(min(max_new_tokens, room))
            out.append(TurnRequest(i, row.traj.context_ids(), row.appended, limit))
        return out

    async def _step(
        self, row: _Row, i: int, turn: int, out: TurnOutput, times: list[float]
    ) -> StepResult:
        text = self.tokenizer.decode(out.ids, skip_special_tokens=True)
        action = Action(text, tuple(out.ids), truncated=not out.stopped)
        t0 = time.perf_counter()
        res = await self._env_call(row.env.step, action, row=i, turn=turn)
        times.append(time.perf_counter() - t0)
        if not isinstance(res, StepResult):
            name = type(row.env).__name__
            raise EnvError(
                f"multi-turn row {i} turn {turn}: {name}.step returned a "
                f"{type(res).__name__}, not a StepResult",
                what=f"{name}.step",
            )
        return res

    def _advance(self, row: _Row, out: TurnOutput, res: StepResult, last: bool, where: str) -> None:
        """One answered turn into its trajectory: the model's ids, the step's reward and
        counters, then the end or the observation."""
        row.traj.add_turn(out.ids, out.logprobs)
        row.reward += res.reward
        for key, value in res.info.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                row.counters[key] = row.counters.get(key, 0.0) + float(value)
        if res.done:
            row.done = True
            return
        if last:
            row.done = row.truncated = True
            return
        try:
            obs = row.encoder.encode(res.observation, closed=out.stopped)
        except ValueError as exc:  # token ids outside the vocabulary (ConfigError: template)
            if isinstance(exc, ConfigError):
                raise
            name = f"{type(row.env).__name__}.step"
            raise EnvError(f"{where}: {name}'s observation: {exc}", what=name) from exc
        # the observation and at least one more model token must fit
        if row.traj.total_tokens + len(obs) + 1 > self.budget:
            row.done = row.truncated = True
            return
        row.traj.add_observation(obs)
        row.appended = len(out.ids) + len(obs)

    # -- environments ----------------------------------------------------------------------
    async def _env_call(self, method: Callable[..., Any], *args: Any, row: int, turn: int) -> Any:
        owner = getattr(method, "__self__", None)
        what = f"{type(owner).__name__}.{getattr(method, '__name__', 'call')}"
        where = f"multi-turn row {row}" + (f" turn {turn}" if turn >= 0 else "")
        try:
            return await call(
                method, *args, timeout_s=self.cfg.env_timeout_s, what=what, setting=_SETTING
            )
        except EnvTimeout as exc:
            raise EnvTimeout(f"{where}: {exc}", what=what) from None
        except EnvError as exc:
            raise EnvError(f"{where}: {exc}", what=exc.what or what) from exc
        except Exception as exc:  # the environment's own bug: named, the micro-batch stops
            raise EnvError(
                f"{where}: {what} raised {type(exc).__name__}: {exc}", what=what
            ) from exc

    async def _bounded(self, coros: list[Any]) -> list[Any]:
        """Run `coros` at most env_concurrency at a time; results in order. The first
        failure cancels the rest (TaskGroup) and propagates."""
        sem = asyncio.Semaphore(self.cfg.env_concurrency)

        async def one(coro: Any) -> Any:
            async with sem:
                return await coro

        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(one(c)) for c in coros]
        except BaseExceptionGroup as group:  # the first failure, as itself (not a group)
            first = next(
                (e for e in group.exceptions if not isinstance(e, asyncio.CancelledError)),
                group.exceptions[0],
            )
            raise first from first.__cause__  # its own cause kept, the group dropped
        return [t.result() for t in tasks]

    async def _close_all(self, envs: list[Environment], *, report: bool = True) -> None:
        """Close every environment built (also after a failure); with `report`, a close
        that failed is raised once, after all were tried."""
        if not envs:
            return
        results = await asyncio.gather(
            *(close_env(env, timeout_s=self.cfg.env_timeout_s) for env in envs),
            return_exceptions=True,
        )
        failed = [r for r in results if isinstance(r, Exception)]
        if failed and report:
            raise EnvError(
                f"multi-turn: {len(failed)} environment close call(s) failed, first: "
                f"{type(failed[0]).__name__}: {failed[0]}",
                what="close",
            ) from failed[0]

    def _encoder(self, env: Environment) -> ObservationEncoder:
        schema_fn = getattr(env, "tools_schema", None)
        tools = list(schema_fn()) if callable(schema_fn) else []
        key = json.dumps(tools, sort_keys=True)
        enc = self._encoders.get(key)
        if enc is None:
            enc = ObservationEncoder(self.tokenizer, tools=tools, stop_token_ids=self.stop_ids)
            self._encoders[key] = enc
        return enc

    def _budget_name(self) -> str:
        return "max_total_tokens" if self.cfg.max_total_tokens else "the model's positions"

    # -- metrics ---------------------------------------------------------------------------
    def _metrics(
        self,
        rows: list[_Row],
        layouts: list[ResponseLayout],
        step_times: list[float],
        env_s: float,
    ) -> dict[str, float]:
        n = len(rows)
        response = sum(len(lay.response_mask) for lay in layouts)
        observed = sum(lay.observation_tokens for lay in layouts)
        metrics = {
            "rollout/turns/mean": sum(lay.num_turns for lay in layouts) / n,
            "rollout/tool_calls": 0.0,
            "rollout/tool_errors": 0.0,
            "rollout/obs_token_frac": observed / response if response else 0.0,
            "rollout/truncated_frac": sum(row.truncated for row in rows) / n,
            "rollout/env_reward/mean": sum(row.reward for row in rows) / n,
            "env/step_s": sum(step_times) / len(step_times) if step_times else 0.0,
            "env/wait_s": env_s,
        }
        keys = sorted({k for row in rows for k in row.counters})
        for key in keys:
            name = _ROLLOUT_COUNTERS.get(key, f"env/{key}")
            metrics[name] = sum(row.counters.get(key, 0.0) for row in rows) / n
        return metrics

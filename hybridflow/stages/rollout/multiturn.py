"""The trajectory loop: multi-turn rollouts, shared by the rollout backends.

A backend hands the loop its single-turn primitive as a `TurnEngine` ("continue these
token rows by one model turn each"); the loop drives it turn by turn and calls the
environment directly, in this process, so per-turn traffic never crosses the
coordinator. One `generate` call (one micro-batch) is one `TrajectoryLoop.run`:

    for each row, concurrently:  env = factory(); first = reset(record)
        prompt = the row's prompt (first is EMPTY) | first's messages templated | its ids
    turn k = 0, 1, ...
        limit_i = min(max_new_tokens, budget - context_i)      budget: max_total_tokens
        out_i   = engine.generate(context_i, limit_i)         seeded (seed, step, mb, k)
        concurrently (at most env_concurrency calls):  res_i = env_i.step(out_i)
        a trajectory ends: res.done | its max_turns-th turn | no budget for the
                           observation plus one token; else context_i += out_i + obs_i
        engine.end([i]) when trajectory i ends (a KV-keeping engine frees its cache)
    close every env; layouts -> collate (what single-turn generate returns, + env_reward)

Two schedules of the same turns (TurnEngine.continuous, turns.py):
  - turn-synchronous (hf): turn k of every live trajectory is one engine call; turn k+1
    starts when turn k's slowest environment step returns (bounded by env_timeout_s).
    The set of trajectories that share a call, and their order, depend only on the
    trajectories themselves, so a seeded run repeats exactly.
  - continuous (native): every trajectory runs on its own; its next turn is submitted
    the moment its environment step returns and joins the engine's running decode batch,
    so a slow tool or a long trajectory holds no other. A request's samples depend on its
    own seed (seed, step, mb, row, turn) alone, so this repeats too (up to the float
    rounding of batched kernels at different batch sizes, as single-turn native does).

Token-in/token-out: turn k+1's input ids are exactly turn k's input ids, plus the ids
the engine generated, plus the observation's ids (stages/env/observations.py). Nothing
already in a context is ever decoded and re-tokenized.

An engine that keeps a trajectory's KV between turns receives `TurnRequest.appended`:
only the last `appended` ids of the context are new since its previous turn.

Errors: an environment whose reset/step/close raises or runs past `env_timeout_s` stops
the micro-batch with an EnvError naming the call, the row, the turn and the bound (a
model's mistake inside a tool is the environment's to turn into an observation,
ToolEnv does). Nothing hangs: every environment call is bounded.

Metrics: turns.py (`loop_metrics`).

Invariants: every trajectory has at least one model turn; a layout ends on a model
token; `env_reward` is the sum of a trajectory's step rewards (its final reward for the
end-only environments of stages/env/builtin), finite float32 (StepResult checks each).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridflow.data.batching import decode_metadata
from hybridflow.errors import BatchError, ConfigError
from hybridflow.stages.base import Batch, StageContext
from hybridflow.stages.common import options_path
from hybridflow.stages.env.layout import Trajectory
from hybridflow.stages.env.observations import ObservationEncoder
from hybridflow.stages.env.protocol import (
    Action,
    EnvError,
    Environment,
    Observation,
    ObservationKind,
    StepResult,
)
from hybridflow.stages.env.registry import make_env_factory
from hybridflow.stages.env.service.process import EnvProcess
from hybridflow.stages.rollout.env_calls import bounded, close_all, env_call
from hybridflow.stages.rollout.state import MULTI_TURN_OUTPUTS
from hybridflow.stages.rollout.turns import (
    LoopResult,
    MultiTurnConfig,
    TurnEngine,
    TurnOutput,
    TurnRequest,
    loop_metrics,
)

__all__ = [
    "LoopResult",
    "MultiTurnConfig",
    "TrajectoryLoop",
    "TurnEngine",
    "TurnOutput",
    "TurnRequest",
    "trajectory_loop",
    "trajectory_records",
]


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
    env_s: float = 0.0  # seconds in this trajectory's environment calls


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
        self.process: EnvProcess | None = None
        if cfg.env_process:  # the options checked above; served by a child, reached as remote
            self.process = EnvProcess.start(
                cfg.env, options, call_timeout_s=cfg.env_timeout_s, path=path
            )
            # its own bound a little inside env_timeout_s: the service's error names it
            t = 0.9 * cfg.env_timeout_s
            remote = {"url": self.process.address, "timeout_s": t, "retries": 0}
            self.factory = make_env_factory("remote", remote, path)
        self.tokenizer = tokenizer
        self.stop_ids = list(stop_token_ids)
        self.budget = min(
            cfg.max_total_tokens or float("inf"), position_limit or float("inf")
        )  # context tokens a trajectory may reach
        self._encoders: dict[str, ObservationEncoder] = {}

    def close(self) -> None:
        """Stop the environment process, if this loop started one."""
        if self.process is not None:
            self.process.close()
            self.process = None

    # -- the loop --------------------------------------------------------------------------
    async def run(
        self,
        engine: TurnEngine,
        prompts: Sequence[Sequence[int]],
        records: Sequence[dict[str, Any]],
        max_new_tokens: int,
    ) -> LoopResult:
        """Every row's trajectory to its end (module docstring)."""
        if self.process is not None:
            self.process.check()  # a dead child: named now (a call to it waits its timeout)
        if len(prompts) != len(records):
            raise BatchError(f"multi-turn: {len(prompts)} prompts but {len(records)} records")
        t_env = [0.0]  # seconds waited on environment calls
        step_times: list[float] = []
        envs: list[Environment] = []
        t_start = time.perf_counter()
        try:
            rows, context, appended = await self._turns(
                engine, prompts, records, max_new_tokens, envs, t_env, step_times
            )
        except BaseException:
            _end(engine, range(len(prompts)))  # nothing kept for trajectories that stopped
            await close_all(
                envs, self.cfg.env_timeout_s, report=False
            )  # the first error is the one to see
            raise
        wall = time.perf_counter() - t_start
        t0 = time.perf_counter()
        await close_all(envs, self.cfg.env_timeout_s)
        t_env[0] += time.perf_counter() - t0
        replaced = any(row.traj.prompt_ids != list(p) for row, p in zip(rows, prompts, strict=True))
        layouts = [row.traj.layout() for row in rows]
        metrics = loop_metrics(
            layouts,
            [row.reward for row in rows],
            [row.truncated for row in rows],
            [row.counters for row in rows],
            step_times,
            t_env[0],
        )
        metrics["rollout/context_tokens"] = float(context)
        metrics["rollout/appended_tokens"] = float(appended)
        metrics["env/time_share"] = (
            sum(row.env_s for row in rows) / len(rows) / wall if wall > 0 else 0.0
        )
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
        rows = await bounded(
            [
                self._start(i, p, r, envs)
                for i, (p, r) in enumerate(zip(prompts, records, strict=True))
            ],
            self.cfg.env_concurrency,
        )
        t_env[0] += time.perf_counter() - t0
        if not getattr(engine, "continuous", False):
            return (rows, *await self._lockstep(engine, rows, max_new_tokens, t_env, step_times))
        sem = asyncio.Semaphore(self.cfg.env_concurrency)  # environment calls, not turns
        counts = await bounded(
            [self._one(engine, rows, i, max_new_tokens, sem, step_times) for i in range(len(rows))],
            len(rows),
        )
        t_env[0] += sum(row.env_s for row in rows) / len(rows)
        return rows, sum(c for c, _ in counts), sum(a for _, a in counts)

    async def _lockstep(
        self,
        engine: TurnEngine,
        rows: list[_Row],
        max_new_tokens: int,
        t_env: list[float],
        step_times: list[float],
    ) -> tuple[int, int]:
        """Turn-synchronous: turn k of every live trajectory in one engine call."""
        context = appended = 0
        for turn in range(self.cfg.max_turns):
            live = [i for i, row in enumerate(rows) if not row.done]
            requests = self._requests(rows, live, max_new_tokens, turn)
            if not requests:
                break
            context += sum(len(r.context_ids) for r in requests)
            appended += sum(r.appended for r in requests)
            outputs = _answered(await engine.generate(requests, turn), requests)
            t0 = time.perf_counter()
            results = await bounded(
                [
                    self._step(rows[r.key], r.key, turn, out, step_times)
                    for r, out in zip(requests, outputs, strict=True)
                ],
                self.cfg.env_concurrency,
            )
            t_env[0] += time.perf_counter() - t0
            last = turn == self.cfg.max_turns - 1
            for r, out, res in zip(requests, outputs, results, strict=True):
                self._advance(rows[r.key], out, res, last, f"multi-turn row {r.key} turn {turn}")
            _end(engine, [r.key for r in requests if rows[r.key].done])
        return context, appended

    async def _one(
        self,
        engine: TurnEngine,
        rows: list[_Row],
        i: int,
        max_new_tokens: int,
        sem: asyncio.Semaphore,
        step_times: list[float],
    ) -> tuple[int, int]:
        """Continuous: trajectory i alone, turn after turn -> (context, appended) tokens."""
        row, context, appended = rows[i], 0, 0
        try:
            for turn in range(self.cfg.max_turns):
                requests = self._requests(rows, [i], max_new_tokens, turn)
                if not requests:
                    break
                context += len(requests[0].context_ids)
                appended += requests[0].appended
                (out,) = _answered(await engine.generate(requests, turn), requests)
                async with sem:
                    res = await self._step(row, i, turn, out, step_times)
                last = turn == self.cfg.max_turns - 1
                self._advance(row, out, res, last, f"multi-turn row {i} turn {turn}")
                if row.done:
                    break
        finally:
            _end(engine, [i])
        return context, appended

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
        first = await env_call(
            env.reset, dict(record), timeout_s=self.cfg.env_timeout_s, row=i, turn=-1
        )
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
        res = await env_call(
            row.env.step, action, timeout_s=self.cfg.env_timeout_s, row=i, turn=turn
        )
        times.append(time.perf_counter() - t0)
        row.env_s += times[-1]
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


def trajectory_loop(
    ctx: StageContext,
    opts: Any,
    tokenizer: Any,
    stop_token_ids: Sequence[int],
    position_limit: int | None,
) -> TrajectoryLoop | None:
    """A rollout backend's loop (None without `env`), after checking that the dataflow
    feeds it each row's record and asks only for outputs a rollout of this kind makes.
    `position_limit`: the most positions a trajectory may reach in this engine."""
    path = options_path(ctx)
    generate = ctx.world.dataflow.get("generate")
    if not opts.env:
        wanted = [o for o in MULTI_TURN_OUTPUTS if generate and o in generate.outputs]
        if wanted:
            raise ConfigError(
                f"{path}.env",
                f"the dataflow asks generate for {wanted}, which only a multi-turn "
                "rollout makes: set env (an environment) or drop them",
            )
        return None
    if generate and "metadata_json" not in generate.inputs:
        raise ConfigError(
            f"{path}.env",
            "a multi-turn rollout resets each environment with its row's record: add "
            "metadata_json to the inputs of the rollout's generate op",
        )
    return TrajectoryLoop(
        MultiTurnConfig.of(opts),
        tokenizer,
        stop_token_ids,
        position_limit=position_limit,
        path=path,
    )


def trajectory_records(batch: Batch, n: int, where: str) -> list[dict[str, Any]]:
    """Each trajectory's record (row i*n+j: prompt i's) from the batch's metadata_json."""
    if "metadata_json" not in batch:
        raise BatchError(
            f"{where}: a multi-turn rollout needs metadata_json (each row's record); "
            f"the batch has {sorted(batch)}"
        )
    try:
        records = decode_metadata(batch["metadata_json"])
    except ValueError as exc:
        raise BatchError(f"{where}: {exc}") from exc
    if len(records) != batch["prompt_ids"].shape[0]:
        raise BatchError(
            f"{where}: metadata_json has {len(records)} rows for "
            f"{batch['prompt_ids'].shape[0]} prompts"
        )
    return [rec for rec in records for _ in range(n)]


def _answered(outputs: list[TurnOutput], requests: Sequence[TurnRequest]) -> list[TurnOutput]:
    if len(outputs) != len(requests):
        raise BatchError(
            f"multi-turn: the engine answered {len(outputs)} of {len(requests)} requests"
        )
    return outputs


def _end(engine: TurnEngine, keys: Sequence[int] | range) -> None:
    """Tell the engine these trajectories are over (engines without `end` keep nothing)."""
    end = getattr(engine, "end", None)
    if end is not None and len(keys):
        end(list(keys))

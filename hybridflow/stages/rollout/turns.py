"""The trajectory loop's vocabulary: what it asks of an engine (`TurnEngine`: one model
turn for each of some token contexts), its settings, and what one run returns.

Kept apart from the loop (multiturn.py) so that backends implement the contract by
importing these names only.

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
  env/step_s                mean seconds of one env.step call
  env/wait_s                turn-synchronous: seconds the loop waited on environment
                            calls; continuous: seconds in environment calls per trajectory
  env/time_share            the share of the loop's wall time its trajectories spent in
                            environment calls (mean over trajectories)
  env/<key>                 per trajectory, the sum of any other numeric `info` entry
                            (won, invalid_guess, tool_s, reward_failures, ...)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hybridflow.data.batching import pad_left
from hybridflow.stages.env.layout import ResponseLayout, collate

__all__ = [
    "LoopResult",
    "MultiTurnConfig",
    "TurnEngine",
    "TurnOutput",
    "TurnRequest",
    "loop_metrics",
]

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
    `turn` is the loop's turn index (the engine seeds its sampling from it).

    `continuous`: the engine batches requests that arrive at different times (the native
    engine), and a request's samples depend on its own seed alone. The loop then runs
    every trajectory on its own: its next turn is submitted as soon as its environment
    step returns and joins the running decode batch. Otherwise (hf) the loop is
    turn-synchronous: one call per turn with every live trajectory.
    `end(keys)`: those trajectories are over (an engine that keeps their K/V frees it)."""

    continuous: bool

    async def generate(self, requests: Sequence[TurnRequest], turn: int) -> list[TurnOutput]: ...

    def end(self, keys: Sequence[int]) -> None: ...


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
    env_process: bool = False  # the environment in a process of its own (service/process.py)

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
            env_process=opts.env_process,
        )


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


def loop_metrics(
    layouts: Sequence[ResponseLayout],
    rewards: Sequence[float],  # per trajectory: its env reward
    truncated: Sequence[bool],  # ... ended by the loop's limits
    counters: Sequence[Mapping[str, float]],  # ... summed numeric `info` entries
    step_times: Sequence[float],  # seconds of every env.step call
    env_s: float,  # env/wait_s (the loop's docstring)
) -> dict[str, float]:
    """One generate call's metrics (module docstring)."""
    n = len(layouts)
    response = sum(len(lay.response_mask) for lay in layouts)
    observed = sum(lay.observation_tokens for lay in layouts)
    metrics = {
        "rollout/turns/mean": sum(lay.num_turns for lay in layouts) / n,
        "rollout/tool_calls": 0.0,
        "rollout/tool_errors": 0.0,
        "rollout/obs_token_frac": observed / response if response else 0.0,
        "rollout/truncated_frac": sum(truncated) / n,
        "rollout/env_reward/mean": sum(rewards) / n,
        "env/step_s": sum(step_times) / len(step_times) if step_times else 0.0,
        "env/wait_s": env_s,
    }
    for key in sorted({k for c in counters for k in c}):
        name = _ROLLOUT_COUNTERS.get(key, f"env/{key}")
        metrics[name] = sum(c.get(key, 0.0) for c in counters) / n
    return metrics

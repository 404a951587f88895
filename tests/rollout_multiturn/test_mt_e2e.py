"""Multi-turn GRPO end to end over real stage processes: the guess-the-number game on a
tiny model with the built-in tokenizer (given a small chat template). The rollout runs
the game in its own process (env: guess_number), the environment's reward reaches the
advantages through the `env` reward backend, colocated in the engine stage. Checked: the
run completes, trajectories take several turns, the collected batch masks observations
out, and the seeded run repeats exactly."""

from __future__ import annotations

import json

import pytest
import torch
from mt_helpers import SIMPLE, chat_tokenizer, tokenizer_dir

from hybridflow.config.schema import load_topology
from hybridflow.errors import ConfigError
from hybridflow.pipeline.plan.planner import build_plan
from hybridflow.pipeline.runtime.runner import run_topology
from hybridflow.stages.common import response_span
from hybridflow.stages.env.builtin.guess_number import make_records

COLLECT = (
    "prompt_ids",
    "response_ids",
    "response_mask",
    "rollout_logprobs",
    "env_reward",
    "num_turns",
    "rewards",
    "advantages",
)
SEQ = ["prompt_ids", "prompt_mask", "response_ids", "response_mask"]


def config(tmp_path, run_name: str, **rollout_options) -> dict:
    data = tmp_path / "games.jsonl"
    if not data.exists():
        rows = make_records(16, 0, low=1, high=3, max_turns=3)
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = str(tmp_path / "tok")
    if not (tmp_path / "tok").exists():
        tokenizer_dir(tmp_path / "tok")
    rollout = {
        "model": "tiny",
        "tokenizer": tok,
        "max_new_tokens": 4,
        "temperature": 1.0,
        "env": "guess_number",
        "env_options": {"low": 1, "high": 3, "max_turns": 3},
        "max_turns": 3,
        **rollout_options,
    }
    model = {"model": "tiny", "tokenizer": tok}
    return {
        "name": "multiturn-grpo",
        "seed": 0,
        "run_dir": str(tmp_path / run_name),
        "run": {"steps": 2, "step_batch": 8, "micro_batch": 4, "max_inflight": 2},
        "data": {
            "source": "prompts",
            "fields": ["prompt_ids", "prompt_mask", "metadata_json", "group_index"],
            "options": {
                "source": str(data),
                "tokenizer": tok,
                "samples_per_prompt": 4,
                "max_prompt_length": 256,
            },
        },
        "stages": {
            "engine": {
                "devices": "cpu",
                "roles": {
                    "rollout": {"backend": "hf", "options": rollout},
                    "reward": {"backend": "env"},
                    "actor": {
                        "backend": "hf",
                        "options": {**model, "lr": 1e-2, "kl_loss_coef": 0.01},
                    },
                    "reference": {"backend": "hf", "options": model},
                },
            }
        },
        "dataflow": [
            {
                "role": "rollout",
                "op": "generate",
                "inputs": ["prompt_ids", "prompt_mask", "metadata_json"],
                "outputs": [
                    "response_ids",
                    "response_mask",
                    "rollout_logprobs",
                    "env_reward",
                    "num_turns",
                ],
                "phase": "rollout",
            },
            {
                "role": "reward",
                "op": "score",
                "inputs": ["env_reward"],
                "outputs": ["rewards"],
                "phase": "reward",
            },
            {
                "role": "reference",
                "op": "get_logprob",
                "inputs": SEQ,
                "outputs": ["ref_logprobs"],
                "phase": "ref",
            },
            {
                "role": "driver",
                "op": "advantages",
                "inputs": ["rewards", "response_mask", "group_index"],
                "outputs": ["advantages"],
                "phase": "adv",
                "params": {"estimator": "grpo"},
            },
            {
                "role": "actor",
                "op": "update",
                "inputs": [*SEQ, "advantages", "rollout_logprobs", "ref_logprobs"],
                "phase": "train",
            },
            {"role": "actor", "op": "optimizer_step", "scope": "step", "phase": "train"},
            {"role": "actor", "op": "reshard", "scope": "step", "phase": "reshard"},
        ],
        "liveness": {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 60.0},
        "metrics": {"backends": ["memory"]},
        "log_level": "WARNING",
    }


def run(tmp_path, name):
    return run_topology(load_topology(config(tmp_path, name)), collect=COLLECT)


def test_multi_turn_grpo_runs_masks_observations_and_repeats_exactly(tmp_path):
    first = run(tmp_path, "a")
    assert [int(m["step"]) for m in first.metrics] == [0, 1]
    tok = chat_tokenizer()
    assert tok.chat_template == SIMPLE
    turns = []
    for got in first.collected.values():
        assert len(got["response_mask"]) == 2  # two micro-batches a step
        for mb in range(2):
            mask, ids = got["response_mask"][mb], got["response_ids"][mb]
            span = response_span(mask)
            observed = span.bool() & ~mask.bool()
            num_turns = got["num_turns"][mb]
            turns += num_turns.tolist()
            for row in range(mask.shape[0]):
                obs_text = tok.decode(ids[row][observed[row]])
                if int(num_turns[row]) > 1:  # the game's feedback sits under mask 0
                    assert "left." in obs_text and "assistant:" in obs_text, obs_text
                else:
                    assert obs_text == ""
            assert bool((got["rollout_logprobs"][mb][observed] == 0).all())
            assert bool((got["advantages"][mb][observed] == 0).all())
            assert torch.equal(got["rewards"][mb], got["env_reward"][mb])
    assert max(turns) > 1
    for row in first.metrics:
        assert row["rollout/turns/mean"] >= 1
        for key in ("rollout/tool_calls", "rollout/tool_errors", "env/step_s", "reward/mean"):
            assert key in row, key
        assert 0 < row["rollout/obs_token_frac"] < 1
    assert any(row["rollout/turns/mean"] > 1 for row in first.metrics)

    second = run(tmp_path, "b")
    for step in first.collected:
        for key in COLLECT:
            for x, y in zip(first.collected[step][key], second.collected[step][key], strict=True):
                assert torch.equal(x, y), (step, key)
    timing = ("timing/", "perf/", "compute/", "env/step_s", "env/wait_s", "env/time_share")
    for a, b in zip(first.metrics, second.metrics, strict=True):
        same = {k: v for k, v in a.items() if not k.startswith(timing) and not k.endswith("_s")}
        assert same == {k: b[k] for k in same}


def test_the_environment_reward_reaches_the_policy_gradient(tmp_path):
    """Rewards that vary (digits per turn, summed over two turns): GRPO advantages are
    nonzero on model tokens, zero on observations, and the actor's gradient moves."""
    cfg = config(
        tmp_path,
        "d",
        env="tests.rollout_multiturn.mt_helpers:DigitsEnv",
        env_options={},
        max_new_tokens=6,
        max_turns=2,
    )
    cfg["run"]["steps"] = 1
    res = run_topology(load_topology(cfg), collect=COLLECT)
    got = res.collected[0]
    rewards = torch.cat(got["rewards"])
    assert torch.equal(rewards, torch.cat(got["env_reward"]))
    assert bool((torch.cat(got["num_turns"]) == 2).all())
    assert float(rewards.std()) > 0, rewards
    nonzero = False
    for mb in range(2):  # one prompt group per micro-batch: a group may agree (adv 0)
        mask, adv = got["response_mask"][mb], got["advantages"][mb]
        observed = response_span(mask).bool() & ~mask.bool()
        assert bool(observed.any()) and bool((adv[observed] == 0).all())
        nonzero |= bool((adv[mask.bool()] != 0).any())
    assert nonzero
    assert res.metrics[0]["reward/mean"] == pytest.approx(float(rewards.mean()), rel=1e-5)
    # equal-length responses make the on-policy GRPO loss 0 itself; its gradient is not
    assert res.metrics[0]["actor/grad_norm"] > 0


def test_plan_time_checks_name_the_key(tmp_path):
    cfg = config(tmp_path, "c", env="guess_numbr")
    with pytest.raises(
        ConfigError, match=r"roles.rollout.options.env: .*did you mean 'guess_number'"
    ):
        build_plan(load_topology(cfg))
    cfg = config(tmp_path, "c", max_turns=0)
    with pytest.raises(ConfigError, match=r"roles.rollout.options.max_turns: must be >= 1"):
        build_plan(load_topology(cfg))
    cfg = config(tmp_path, "c")
    cfg["dataflow"][1]["inputs"] = ["response_ids"]
    with pytest.raises(
        ConfigError, match=r"dataflow\[1\].inputs: EnvReward.score needs \['env_reward'\]"
    ):
        build_plan(load_topology(cfg))

"""`define_training_step(outputs=...)` is the contract of `engine.run` (issue 13, item 1),
and typos anywhere in a topology fail at validate (item 6).

Real stage processes, tiny models, CPU. `run(prompts)` returns exactly the declared
outputs: text as str lists, per-sample numbers as tensors with one row per prompt,
step-level values (a loss, a KL) as 0-d tensors. A logic that updates a role trains one
step on the prompts; one that does not leaves the weights alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridflow import DataflowBuilder
from hybridflow.config.loader import to_dict
from hybridflow.config.schema import load_topology
from hybridflow.errors import CompileError, ConfigError
from hybridflow.pipeline.checkpoint.stage import policy_weights
from hybridflow.pipeline.plan.planner import build_plan

REWARD = "hybridflow.data.tasks:last_digit_reward"
GENERATE_AND_SCORE = """
response = actor.generate(prompt)
reward_score = reward.score(prompt, response)
"""
# The PPO logic of docs/guide/python-api.md (KL as a penalty in the reward, measured by the update).
PPO = """
response = actor.generate(prompt)
reward_score = reward.score(prompt, response)
ref_logprob = ref.get_logprob(prompt, response)
actor_logprob = actor.get_logprob(prompt, response)
kl_div = actor_logprob - ref_logprob
loss = ppo_loss(reward_score, kl_div)
actor.update(loss)
"""
PROMPTS = ["last:40719=", "last:582=", "last:1234="]


def builder(
    logic: str, outputs: list[str], *, ref: bool = False, reward: str = REWARD
) -> DataflowBuilder:
    df = DataflowBuilder("contract", seed=5)
    df.add_actor("tiny", device_mapping="cpu", lr=1e-2, max_new_tokens=3)
    if ref:
        df.add_reference_model("tiny")
    df.add_reward_function(reward, device_mapping="cpu")  # one process hosts everything
    df.define_training_step(inputs=["prompt"], outputs=outputs, logic=logic)
    df.configure(step_batch=4, micro_batch=2)
    return df


def actor_weights(checkpoint: str) -> dict[str, torch.Tensor]:
    return policy_weights(Path(checkpoint))


def test_issue_snippet_generates_and_scores_with_the_declared_keys(tmp_path):
    # Any prompt text: a reward that scores any response.
    brevity = "tests.api.reward_fns:brevity_reward"
    df = builder(GENERATE_AND_SCORE, ["response", "reward_score"], reward=brevity)
    with df.build(metrics_backend="null", log_dir=tmp_path) as engine:
        # As written in the issue:
        results = engine.run(["Explain quantum computing in simple terms."])
        print("Response:", results["response"][0])
        print("Reward score:", results["reward_score"][0].item())

        assert set(results) == {"response", "reward_score"}
        assert isinstance(results["response"][0], str)
        assert results["reward_score"].shape == (1,)
        assert isinstance(results["reward_score"][0].item(), float)

        many = engine.run(PROMPTS)
        assert len(many["response"]) == 3 and all(isinstance(r, str) for r in many["response"])
        assert many["reward_score"].shape == (3,)
        assert all(0.0 < r <= 1.0 for r in many["reward_score"].tolist())
        # Nothing trains: no step, no checkpoint, the same policy samples the same text.
        assert engine.step == 0 and engine.state is None and engine.history == []
        again = engine.run(PROMPTS)
        assert again["response"] == many["response"]
        assert torch.equal(again["reward_score"], many["reward_score"])


def test_ppo_logic_run_is_one_training_step_with_the_declared_outputs(tmp_path):
    df = builder(PPO, ["loss", "kl_div", "rewards"], ref=True)
    with df.build(metrics_backend="jsonl", log_dir=tmp_path) as engine:
        first = engine.run(PROMPTS)
        assert set(first) == {"loss", "kl_div", "rewards"}
        for name in ("loss", "kl_div"):  # step-level values: 0-d tensors
            assert first[name].ndim == 0 and torch.isfinite(first[name]), name
        assert first["kl_div"].item() == 0.0  # the policy starts as the reference
        assert first["rewards"].shape == (3,) and first["rewards"].dtype.is_floating_point
        # One training step: the policy advanced, checkpointed, logged like train's.
        assert engine.step == 1 and engine.history[-1]["actor/policy_version"] == 1.0
        assert engine.history[-1]["actor/pg_loss"] == pytest.approx(first["loss"].item())
        after_one = actor_weights(engine.state)
        second = engine.run(PROMPTS)
        assert engine.step == 2 and engine.history[-1]["actor/policy_version"] == 2.0
        after_two = actor_weights(engine.state)
        assert any(not torch.equal(after_one[k], after_two[k]) for k in after_one)
        assert second["kl_div"].item() > 0  # the trained policy left the reference
        rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1]
        # train() continues from there, on the same processes.
        pids = engine.pids()
        result = engine.train("last_digit", steps=1)
        assert engine.pids() == pids and [r["step"] for r in result.metrics] == [2]
        assert result.metrics[0]["actor/policy_version"] == 3.0


def test_groups_of_samples_come_back_one_row_per_prompt(tmp_path):
    logic = """
    response = actor.generate(prompt, n=2)
    reward_score = reward.score(prompt, response)
    loss = grpo_loss(reward_score)
    actor.update(loss)
    """
    df = builder(logic, ["response", "reward_score", "loss", "prompt"])
    with df.build(metrics_backend="null", log_dir=tmp_path) as engine:
        out = engine.run(PROMPTS)
    assert list(out) == ["response", "reward_score", "loss", "prompt"]
    assert out["prompt"] == PROMPTS
    assert len(out["response"]) == 3 and all(len(r) == 2 for r in out["response"])
    assert out["reward_score"].shape == (3, 2) and out["loss"].ndim == 0
    assert engine.step == 1


def test_a_declared_output_the_step_never_computes_is_a_compile_error():
    with pytest.raises(CompileError, match="output 'kl_div' is never produced"):
        builder(GENERATE_AND_SCORE, ["response", "kl_div"])
    no_update = GENERATE_AND_SCORE + "loss = ppo_loss(reward_score)\n"
    with pytest.raises(CompileError, match="output 'loss': loss is a loss no update minimizes"):
        builder(no_update, ["loss"])
    kl_only = """
    response = actor.generate(prompt)
    reward_score = reward.score(prompt, response)
    ref_logprob = ref.get_logprob(prompt, response)
    actor_logprob = actor.get_logprob(prompt, response)
    kl_div = actor_logprob - ref_logprob
    """
    with pytest.raises(CompileError, match="output 'kl_div': the KL kl_div is measured by"):
        builder(kl_only, ["kl_div"], ref=True)
    advantages = GENERATE_AND_SCORE + "adv = grpo(reward_score)\n"
    with pytest.raises(CompileError, match="output 'adv': adv is never computed"):
        builder(advantages.replace("prompt)\n", "prompt, n=2)\n", 1), ["adv"])
    with pytest.raises(CompileError, match="output 'response' is declared twice"):
        builder(GENERATE_AND_SCORE, ["response", "response"])


# ------------------------------------------------------------------ item 6: typos


def _preset(name: str = "grpo") -> dict:
    return to_dict(load_topology(name))


def _op(data: dict, role: str, op: str) -> dict:
    return next(o for o in data["dataflow"] if o["role"] == role and o["op"] == op)


def test_op_and_option_typos_fail_at_validate_with_their_keys():
    data = _preset()
    _op(data, "rollout", "generate")["params"] = {"temprature": 0.5}
    i = data["dataflow"].index(_op(data, "rollout", "generate"))
    with pytest.raises(ConfigError, match=rf"dataflow\[{i}\]\.params\.temprature: .*'temperature'"):
        build_plan(load_topology(data))

    data = _preset()
    _op(data, "actor", "reshard")["params"] = {"bucket": 1}
    i = data["dataflow"].index(_op(data, "actor", "reshard"))
    with pytest.raises(ConfigError, match=rf"dataflow\[{i}\]\.params\.bucket: "):
        build_plan(load_topology(data))

    data = _preset()
    adv = _op(data, "driver", "advantages")
    adv["op"] = "advantage"
    i = data["dataflow"].index(adv)
    with pytest.raises(ConfigError, match=rf"dataflow\[{i}\]\.op: .*did you mean 'advantages'"):
        build_plan(load_topology(data))

    data = _preset()
    data["dataflow"].append(
        {
            "role": "driver",
            "op": "hybridflow.pipeline.driver.expr:arith",
            "inputs": ["rewards"],
            "outputs": ["bonus"],
            "params": {"expr": "2 * rewards", "ouptut": "bonus"},
        }
    )
    with pytest.raises(ConfigError, match=r"dataflow\[\d+\]\.params\.ouptut: .*'output'"):
        build_plan(load_topology(data))
    data["dataflow"][-1]["params"] = {"expr": "2 * rewards +", "output": "bonus"}
    with pytest.raises(ConfigError, match=r"dataflow\[\d+\]\.params\.expr: "):
        build_plan(load_topology(data))

    data = _preset()
    data["dataflow"].append(
        {
            "role": "driver",
            "op": "identity",
            "inputs": ["rewards"],
            "outputs": ["rewards_out"],
            "params": {"scale": 2},
        }
    )
    with pytest.raises(ConfigError, match=r"dataflow\[\d+\]\.params\.scale: "):
        build_plan(load_topology(data))


def test_synthetic_role_option_typos_fail_at_validate():
    data = _preset("overlap")  # every role synthetic
    stage, roles = next((s, c["roles"]) for s, c in data["stages"].items())
    role = next(iter(roles))
    roles[role]["options"] = {"ms_per_smaple": 1.0}
    key = rf"stages\.{stage}\.roles\.{role}\.options\.ms_per_smaple: .*'ms_per_sample'"
    with pytest.raises(ConfigError, match=key):
        build_plan(load_topology(data))
    roles[role]["options"] = {"ops": {"reshard": {"ms_per_tsk": 2}}}
    with pytest.raises(ConfigError, match=r"options\.ops\.reshard\.ms_per_tsk: "):
        build_plan(load_topology(data))

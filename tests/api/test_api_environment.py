"""DataflowBuilder.add_environment: the multi-turn form of a job (an environment in the
rollout, its reward as the run's reward) compiles to the dataflow that
tests/rollout_multiturn/test_mt_e2e.py writes by hand, and plans. No processes here."""

from __future__ import annotations

import pytest

from hybridflow import DataflowBuilder
from hybridflow.errors import ConfigError
from hybridflow.pipeline.plan.planner import build_plan

GRPO = """
response = actor.generate(prompt, n=4)
reward_score = reward.score(prompt, response)
loss = grpo_loss(reward_score)
actor.update(loss)
"""


def builder(**env) -> DataflowBuilder:
    df = DataflowBuilder("agent")
    df.add_actor(model_name="tiny", device_mapping="cpu", max_new_tokens=8)
    df.add_environment("calculator", {"max_turns": 3}, max_turns=3, **env)
    df.define_training_step(inputs=["prompt"], outputs=["loss", "rewards"], logic=GRPO)
    return df


def test_the_environment_reward_form_compiles_to_the_multi_turn_dataflow():
    topo = builder(max_total_tokens=64).topology()
    assert {s: sorted(c.roles) for s, c in topo.stages.items()} == {
        "engine": ["actor", "reward", "rollout"]  # the env reward beside the rollout
    }
    roles = topo.stages["engine"].roles
    assert roles["reward"].backend == "env"
    rollout = roles["rollout"].options
    assert rollout["env"] == "calculator" and rollout["env_options"] == {"max_turns": 3}
    assert rollout["max_turns"] == 3 and rollout["max_total_tokens"] == 64
    ops = {(op.role, op.op): op for op in topo.dataflow}
    gen = ops[("rollout", "generate")]
    assert gen.inputs == ("prompt_ids", "prompt_mask", "metadata_json")
    assert gen.outputs[-2:] == ("env_reward", "num_turns")
    assert ops[("reward", "score")].inputs == ("env_reward",)
    assert "metadata_json" in topo.data.fields
    build_plan(topo)  # the registries accept it: env name, env_options, op inputs


def test_reward_false_keeps_a_reward_of_your_own():
    df = DataflowBuilder("agent")
    df.add_actor(model_name="tiny", device_mapping="cpu")
    df.add_environment("calculator", reward=False)
    df.add_reward_function("hybridflow.reward.scorers.gsm8k:compute_score")
    df.define_training_step(inputs=["prompt"], outputs=["loss", "rewards"], logic=GRPO)
    topo = df.topology()
    score = next(op for op in topo.dataflow if op.op == "score")
    assert "env_reward" not in score.inputs and "response_ids" in score.inputs
    gen = next(op for op in topo.dataflow if op.op == "generate")
    assert "metadata_json" in gen.inputs and "env_reward" in gen.outputs


def test_add_environment_errors_name_the_call():
    with pytest.raises(ConfigError, match="add_environment: add the actor first"):
        DataflowBuilder().add_environment("calculator")
    df = DataflowBuilder()
    df.add_actor(model_name="tiny")
    with pytest.raises(ConfigError, match=r"add_environment\.env: must look like"):
        df.add_environment("pkg.mod:")
    df.add_environment("calculator")
    with pytest.raises(ConfigError, match="already has env 'calculator'"):
        df.add_environment("guess_number")
    df = builder()
    df._roles["rollout"].options["env"] = "calculater"
    with pytest.raises(ConfigError, match="did you mean 'calculator'"):
        build_plan(df.topology())

"""Role names come from one table (config/stages.py ROLE_NAMES): the Python API's device
mappings and the step logic accept the same names for a role (`ref` / `reference`,
`reward` / `rm`), and both resolve them the same way. No processes here."""

from __future__ import annotations

import pytest

from hybridflow import DataflowBuilder
from hybridflow.config.stages import ROLE_KINDS, ROLE_NAMES, role_kind
from hybridflow.errors import CompileError, ConfigError
from hybridflow.pipeline.compiler.frontend import compile_step
from hybridflow.pipeline.compiler.grammar import ROLES, logic_name


def test_every_name_resolves_to_its_kind():
    for kind, names in ROLE_NAMES.items():
        assert all(role_kind(n) == kind for n in names)
    assert role_kind("ref") == "reference" and role_kind("rm") == "reward"
    assert role_kind("judge") == "judge"  # a role of a custom kind keeps its name
    assert ROLE_KINDS == ("rollout", "actor", "critic", "reference", "reward")


REF_LOGIC = """
response = actor.generate(prompt)
reward_score = reward.score(prompt, response)
ref_logprob = {who}.get_logprob(prompt, response)
actor_logprob = actor.get_logprob(prompt, response)
kl_div = actor_logprob - ref_logprob
loss = grpo_loss(reward_score, kl_div)
actor.update(loss)
"""


def test_the_logic_takes_every_name_of_a_role_but_the_rollout():
    """Every name of the reference's row compiles to the same reference op; the rollout
    is no name of the logic (it is reached through actor.generate), and the refusal lists
    the names that work, the preferred one of each role."""
    roles = ["actor", "rollout", "reference", "reward"]
    plans = [
        compile_step(REF_LOGIC.format(who=who), ["prompt"], ["loss"], roles).dataflow
        for who in ROLE_NAMES["reference"]
    ]
    assert len(plans) == 2 and all(p == plans[0] for p in plans)
    assert [op.op for op in plans[0] if op.role == "reference"] == ["get_logprob"]
    assert set(ROLES.values()) == set(ROLE_KINDS) - {"rollout"}
    logic = LOGIC.format(who="reward").replace("actor.generate", "rollout.generate")
    with pytest.raises(CompileError, match=r"the roles are actor, critic, ref, reward\n"):
        compile_step(logic, ["prompt"], ["loss"], ["actor", "rollout", "reward"])
    assert logic_name("reference") == "ref" and logic_name("reward") == "reward"


LOGIC = """
response = actor.generate(prompt)
reward_score = {who}.score(prompt, response)
loss = ppo_loss(reward_score)
actor.update(loss)
"""


def test_rm_in_the_logic_is_the_reward():
    roles = ["actor", "rollout", "reward"]
    a = compile_step(LOGIC.format(who="reward"), ["prompt"], ["loss"], roles)
    b = compile_step(LOGIC.format(who="rm"), ["prompt"], ["loss"], roles)
    assert a.dataflow == b.dataflow


def _builder(**reward_mapping: str) -> DataflowBuilder:
    df = DataflowBuilder()
    df.add_actor("tiny", device_mapping="cpu")
    df.add_reference_model("tiny", device_mapping={"reference": "cpu"})
    df.add_reward_function("hybridflow.data.tasks:last_digit_reward", device_mapping=reward_mapping)
    df.define_training_step(["prompt"], ["loss"], LOGIC.format(who="reward"))
    return df


@pytest.mark.parametrize("name", ["reward", "rm"])
def test_device_mappings_take_every_name_of_a_role(name):
    topo = _builder(**{name: "cpu:2"}).topology(cuda_count=0)
    where = {role: stage for stage, cfg in topo.stages.items() for role in cfg.roles}
    assert where["reference"] == where["actor"] and where["reward"] != where["actor"]
    over = _builder(reward="cpu:2").topology(cuda_count=0, device_mapping={"ref": "cpu:3"})
    where = {role: stage for stage, cfg in over.stages.items() for role in cfg.roles}
    assert where["reference"] != where["actor"]


def test_a_name_of_another_role_is_refused_with_the_names_that_work():
    with pytest.raises(ConfigError, match=r"device_mapping\.actor: .* use 'ref' or 'reference'"):
        DataflowBuilder().add_reference_model("tiny", device_mapping={"actor": "cpu"})

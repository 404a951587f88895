"""Loss options in the step logic are named after the option they set (the actor's
kl_loss_coef / kl_loss_type / clip_ratio_low for grpo_loss, the `advantages` op's
kl_coef / kl_penalty for ppo_loss's KL penalty), and the older spellings (kl_coef and
kl_type on grpo_loss, kl_type on ppo_loss, clip_ratio, kl_penalty's coef) still compile to
the same plan. A KL option that has no KL to apply to, or names another estimator than
the KL it applies to, is refused."""

from __future__ import annotations

import pytest

from hybridflow.errors import CompileError
from hybridflow.pipeline.compiler.frontend import compile_step
from hybridflow.pipeline.compiler.grammar import ACTOR_LOSS_OPTIONS, ALGORITHMS

NO_CRITIC = ["actor", "rollout", "reference", "reward"]
ALL = [*NO_CRITIC, "critic"]
HEAD = """
response = actor.generate(prompt, n=4)
reward_score = reward.score(prompt, response)
ref_logprob = ref.get_logprob(prompt, response)
actor_logprob = actor.get_logprob(prompt, response)
kl_div = kl(actor_logprob, ref_logprob, kind="k3")
"""


def _compile(loss: str, roles: list[str] = NO_CRITIC):
    return compile_step(f"{HEAD}loss = {loss}\nactor.update(loss)", ["prompt"], ["loss"], roles)


def _actor(loss: str) -> dict:
    return _compile(loss).role_options["actor"]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("kl_coef=0.2", "kl_loss_coef=0.2"),
        ('kl_type="k3"', 'kl_loss_type="k3"'),
        ('kl_type="low_var_kl"', 'kl_loss_type="k3"'),  # verl's name of k3
        ("clip_ratio=0.3", "clip_ratio_low=0.3"),
    ],
)
def test_grpo_loss_takes_the_actor_names_and_the_old_spellings(old, new):
    a = _compile(f"grpo_loss(reward_score, kl_div, {old})")
    b = _compile(f"grpo_loss(reward_score, kl_div, {new})")
    assert a.dataflow == b.dataflow and a.role_options == b.role_options


def test_the_actor_gets_what_the_logic_said():
    actor = _actor("grpo_loss(reward_score, kl_div, kl_loss_coef=0.2, clip_ratio_low=0.3)")
    assert actor["kl_loss_coef"] == 0.2 and actor["kl_loss_type"] == "k3"
    assert actor["clip_ratio_low"] == 0.3


def test_ppo_loss_kl_options_are_the_advantages_op_s():
    for loss in (
        'ppo_loss(reward_score, kl_div, kl_coef=0.05, kl_penalty="k3")',
        'ppo_loss(reward_score, kl_div, kl_coef=0.05, kl_type="k3")',
    ):
        adv = next(op for op in _compile(loss, ALL).dataflow if op.op == "advantages")
        assert adv.params["kl_coef"] == 0.05 and adv.params["kl_penalty"] == "k3"


def test_kl_penalty_takes_kl_coef_and_the_old_coef():
    base = HEAD.replace('kind="k3"', 'kind="k1"')
    plans = [
        compile_step(
            f"{base}s = kl_penalty(reward_score, kl_div, {opt}=0.1)\nloss = ppo_loss(s)\n"
            "actor.update(loss)",
            ["prompt"],
            ["loss"],
            ALL,
        ).dataflow
        for opt in ("kl_coef", "coef")
    ]
    assert plans[0] == plans[1]


@pytest.mark.parametrize(
    ("loss", "reason"),
    [
        ("grpo_loss(reward_score, kl_div, kl_coef=0.1, kl_loss_coef=0.1)", "set the same option"),
        ("grpo_loss(reward_score, kl_loss_coef=0.1)", "applies to the loss's KL argument"),
        ("ppo_loss(reward_score, kl_coef=0.1)", r"pass the KL: ppo_loss\(score, kl, kl_coef"),
        ('grpo_loss(reward_score, kl_div, kl_loss_type="k1")', "disagrees with kl_div, a k3"),
        ('grpo_loss(reward_score, kl_div, kl_type="k9")', "kl_loss_type= must be one of"),
        ("grpo_loss(reward_score, kl_div, kl_penalty='k3')", "no option 'kl_penalty'"),
        ("ppo_loss(reward_score, kl_div, kl_loss_coef=0.1)", "no option 'kl_loss_coef'"),
    ],
)
def test_kl_options_that_apply_to_nothing_or_disagree_are_refused(loss, reason):
    with pytest.raises(CompileError, match=reason):
        _compile(loss, ALL)


def test_loss_options_are_actor_options_and_aliases_name_real_options():
    from dataclasses import fields

    from hybridflow.stages.actor import ActorOptions

    actor = {f.name for f in fields(ActorOptions)}
    assert set(ACTOR_LOSS_OPTIONS) <= actor
    assert {"kl_loss_coef", "kl_loss_type"} <= actor
    for name, algo in ALGORITHMS.items():
        for alias, option in algo.aliases.items():
            assert option in algo.options and alias not in algo.options, (name, alias)

"""The step-logic compiler: the issue's seed logic and the presets' logic compile to the
bundled YAML presets' dataflow; everything outside the grammar is refused with its line."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from hybridflow.config.schema import load_topology
from hybridflow.errors import CompileError
from hybridflow.pipeline.compiler.frontend import KINDS, analyze, compile_step
from hybridflow.pipeline.compiler.ir import (
    KL,
    Alias,
    Apply,
    Arith,
    Call,
    Penalty,
    StepIR,
    StepOutput,
    Value,
)
from hybridflow.pipeline.compiler.lowering import lower
from hybridflow.pipeline.driver import expr
from hybridflow.pipeline.plan.planner import build_plan

ALL = ["actor", "rollout", "reference", "critic", "reward"]
NO_CRITIC = ["actor", "rollout", "reference", "reward"]

# The seed logic (with a critic declared: PPO, GAE, KL penalty in the reward).
SEED = """
response = actor.generate(prompt)
reward_score = reward.score(prompt, response)
ref_logprob = ref.get_logprob(prompt, response)
actor_logprob = actor.get_logprob(prompt, response)
kl_div = actor_logprob - ref_logprob
loss = ppo_loss(reward_score, kl_div)
actor.update(loss)
"""

GRPO = """
response = actor.generate(prompt, n=8)
reward_score = reward.score(prompt, response)
ref_logprob = ref.get_logprob(prompt, response)
actor_logprob = actor.get_logprob(prompt, response)
kl_div = kl(actor_logprob, ref_logprob, kind="k3")
loss = grpo_loss(reward_score, kl_div, kl_coef=0.01)
actor.update(loss)
"""

OUTPUTS = ["loss", "kl_div", "rewards"]


def test_seed_logic_compiles_to_the_ppo_preset():
    preset = load_topology("ppo")
    # The preset sets GAE's lam to 0.95 (the default is verl's 1.0): the logic says so too.
    logic = SEED.replace(
        "ppo_loss(reward_score, kl_div)", "ppo_loss(reward_score, kl_div, lam=0.95)"
    )
    cs = compile_step(logic, ["prompt"], OUTPUTS, ALL)
    assert cs.dataflow == preset.dataflow
    plain = compile_step(SEED, ["prompt"], OUTPUTS, ALL)  # lam left to the default
    adv = next(op for op in plain.dataflow if op.op == "advantages")
    assert adv.params["lam"] == 1.0
    assert cs.data_fields == preset.data.fields
    actor = preset.stages["engine"].roles["actor"].options
    for key, value in cs.role_options["actor"].items():
        assert actor[key] == value, key
    assert (
        cs.role_options["data"]["samples_per_prompt"] == preset.data.options["samples_per_prompt"]
    )
    # Step-level values are the update's metrics; per-sample ones are collected tensors.
    assert cs.outputs == {
        "loss": StepOutput("policy_loss", "", "actor/pg_loss"),
        "kl_div": StepOutput("kl", "", "actor/kl"),
        "rewards": StepOutput("score", "rewards", "reward/mean"),
    }
    assert cs.collect == ("rewards",) and cs.trains


def test_grpo_logic_compiles_to_the_grpo_preset():
    preset = load_topology("grpo")
    cs = compile_step(GRPO, ["prompt"], OUTPUTS, NO_CRITIC)
    assert cs.dataflow == preset.dataflow
    assert cs.data_fields == preset.data.fields
    actor = preset.stages["engine"].roles["actor"].options
    for key, value in cs.role_options["actor"].items():
        assert actor[key] == value, key
    assert (
        cs.role_options["data"]["samples_per_prompt"] == preset.data.options["samples_per_prompt"]
    )


def test_order_of_independent_lines_and_explicit_forms_do_not_change_the_plan():
    reordered = """
    response = actor.generate(prompt)
    actor_logprob = actor.get_logprob(response)
    ref_logprob = ref.get_logprob(prompt, response)
    kl_div = actor_logprob - ref_logprob
    reward_score = reward.score(prompt, response)
    loss = ppo_loss(reward_score, kl_div, kl_coef=0.05)
    actor.update(loss)
    """
    explicit = """
    response = actor.generate(prompt)
    values = critic.values(prompt, response)
    reward_score = reward.score(prompt, response)
    ref_logprob = ref.get_logprob(prompt, response)
    actor_logprob = actor.get_logprob(prompt, response)
    kl_div = actor_logprob - ref_logprob
    shaped = reward_score - 0.05 * kl_div
    advantages = gae(shaped, values)
    loss = ppo_loss(advantages)
    actor.update(loss)
    vloss = value_loss(values, advantages)
    critic.update(vloss)
    """
    a = compile_step(reordered, ["prompt"], ["loss"], ALL)
    b = compile_step(explicit, ["prompt"], ["loss"], ALL)
    assert a.dataflow == b.dataflow
    adv = next(op for op in a.dataflow if op.op == "advantages")
    assert adv.params["kl_coef"] == 0.05 and "kl_target" not in adv.params  # fixed coefficient


def test_independent_calls_depend_only_on_the_response():
    preset = load_topology("ppo")
    plan = build_plan(preset)
    by_label = {op.label: op for op in plan.ops}
    gen = by_label["rollout.generate"].index
    for label in ("reward.score", "reference.get_logprob", "critic.values"):
        assert by_label[label].deps == (gen,), label  # start as soon as `response` exists
    assert not by_label["reward.score"].is_step and by_label["actor.reshard"].is_step


def test_derived_scores_and_reported_arithmetic_become_driver_ops():
    logic = """
    response = actor.generate(prompt)
    reward_score = reward.score(prompt, response)
    bonus = 2 * reward_score + 1
    loss = ppo_loss(bonus)
    actor.update(loss)
    """
    cs = compile_step(logic, ["prompt"], ["loss", "bonus"], ["actor", "rollout", "reward"])
    ops = {op.op: op for op in cs.dataflow}
    arith = ops["hybridflow.pipeline.driver.expr:arith"]
    assert arith.inputs == ("rewards",) and arith.params == {
        "expr": "2 * rewards + 1",
        "output": "bonus",
    }
    adv = ops["hybridflow.pipeline.driver.expr:ScoreAdvantages"]
    assert adv.inputs[0] == "bonus" and adv.params["score"] == "bonus"
    assert adv.params["estimator"] == "reinforce_pp"  # no critic, not grpo_loss
    assert cs.outputs["bonus"] == StepOutput("score", "bonus", "") and cs.collect == ("bonus",)
    out, _ = expr.arith({"rewards": torch.tensor([0.0, 0.5])}, dict(arith.params))
    assert torch.equal(out["bonus"], torch.tensor([1.0, 2.0]))


def test_arith_broadcasts_per_sample_over_tokens_and_zeroes_padding():
    batch = {
        "rewards": torch.tensor([1.0, 2.0]),
        "ref_logprobs": torch.tensor([[0.5, 0.5], [1.0, 0.0]]),
        "response_mask": torch.tensor([[1, 1], [1, 0]]),
    }
    out, _ = expr.arith(batch, {"expr": "rewards - 2 * ref_logprobs", "output": "x"})
    assert torch.equal(out["x"], torch.tensor([[0.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(Exception, match="not allowed"):
        expr.arith(batch, {"expr": "rewards.__class__", "output": "x"})


@pytest.mark.parametrize(
    ("logic", "line", "reason"),
    [
        ("import os\nresponse = actor.generate(prompt)", 1, "imports are not allowed"),
        (
            "response = actor.generate(prompt)\nx = os.system(prompt)",
            2,
            "attributes of other objects",
        ),
        ("for i in prompt:\n    response = actor.generate(prompt)", 1, "loops are not allowed"),
        ("f = lambda x: x", 1, "lambdas are not allowed"),
        ("response = actor.generate(prompt.__class__)", 1, "dunder names"),
        ("response = actor.generate(prompt[0])", 1, "subscripts are not allowed"),
        ("response = actor.generate(prompt)\nx = open(response)", 2, "unknown function 'open'"),
        ("response = actor.model.generate(prompt)", 1, "attribute chains"),
        (
            "response = actor.generate(prompt)\nresponse = reward.score(prompt, response)",
            2,
            "assigned exactly once",
        ),
        (
            "score = reward.score(prompt, response)\nresponse = actor.generate(prompt)",
            1,
            "used before it is assigned",
        ),
        ("response = actor.generate(prompt)\nx = 3", 2, "a constant alone"),
        ("response = actor.generate(prompt)\nactor.train(response)", 2, "not a method of actor"),
        (
            "response = actor.generate(prompt)\ns = reward.score(prompt, response)\nl = ppo_loss(s, clip=2)",
            3,
            "no option 'clip'",
        ),
        ("response = actor.generate(prompt)\nl = ppo_loss(response)", 2, "ppo_loss(...) takes"),
        ("response = actor.generate(prompt)\nif response:\n    pass", 2, "conditionals"),
        ("response = actor.generate(prompt)\nx = response + 1", 2, "token sequence"),
        ("response = actor.generate(prompt, temperature=t)", 1, "must be a constant"),
        ("response = actor.generate(prompt)\nx += 1", 2, "assigned once"),
    ],
)
def test_rejected_logic_names_line_and_reason(logic, line, reason):
    with pytest.raises(CompileError) as info:
        compile_step(logic, ["prompt"], [], ALL)
    assert info.value.line == line, str(info.value)
    assert reason in str(info.value)
    assert f"logic line {line}" in str(info.value)


def test_inputs_outputs_and_missing_roles_are_checked():
    with pytest.raises(CompileError, match="output 'advantage' is never produced"):
        compile_step(SEED, ["prompt"], ["advantage"], ALL)
    with pytest.raises(CompileError, match="input 'question' is not a value"):
        compile_step(SEED, ["question"], [], ALL)
    with pytest.raises(CompileError, match="needs a reference model"):
        compile_step(SEED, ["prompt"], [], ["actor", "rollout", "critic", "reward"])
    with pytest.raises(CompileError, match="GAE needs a critic"):
        compile_step(
            SEED.replace(
                "ppo_loss(reward_score, kl_div)", "ppo_loss(reward_score, kl_div, estimator='gae')"
            ),
            ["prompt"],
            [],
            NO_CRITIC,
        )
    with pytest.raises(CompileError, match="never generates"):
        compile_step("x = prompt", ["prompt"], [], ALL)


def test_every_kind_names_its_runtime_tensors():
    # The one table from logic names to wire names (documentation is tested too).
    assert KINDS["score"].fields == ("rewards",)
    assert KINDS["response"].fields[:2] == ("response_ids", "response_mask")
    assert all(k.doc for k in KINDS.values())


# ------------------------------------------------------------------ the typed IR

PROMPT = Value("prompt", "prompt", 0)


def _seq_calls(gen_params: dict) -> tuple[Call, ...]:
    """Lines 1-4 shared by SEED and GRPO: generate, score, ref and actor log-probs."""
    response = Value("response", "response", 1)
    seq = (PROMPT, response)
    return (
        Call(1, "rollout", "generate", (PROMPT,), response, gen_params),
        Call(2, "reward", "score", seq, Value("reward_score", "score", 2)),
        Call(3, "reference", "get_logprob", seq, Value("ref_logprob", "ref_logprob", 3)),
        Call(4, "actor", "get_logprob", seq, Value("actor_logprob", "actor_logprob", 4)),
    )


@pytest.mark.parametrize(
    ("logic", "roles", "gen_params", "kl_estimator", "loss_fn", "loss_options"),
    [
        # Options by the names they set: `kl_coef` is grpo_loss's old spelling.
        (GRPO, NO_CRITIC, {"n": 8}, "k3", "grpo_loss", {"kl_loss_coef": 0.01}),
        (SEED, ALL, {}, "k1", "ppo_loss", {}),  # `actor_logprob - ref_logprob` folds to KL
    ],
    ids=["grpo", "ppo"],
)
def test_the_frontend_produces_typed_ir(
    logic, roles, gen_params, kl_estimator, loss_fn, loss_options
):
    ir = analyze(logic, ["prompt"], OUTPUTS, roles)
    assert isinstance(ir, StepIR)
    gen, score, ref, alp = _seq_calls(gen_params)
    kl_div = Value("kl_div", "kl", 5)
    loss = Value("loss", "policy_loss", 6)
    assert ir.inputs == (PROMPT,)
    assert ir.calls == (gen, score, ref, alp, Call(7, "actor", "update", (loss,), None))
    assert dict(ir.assigns) == {
        "response": gen,
        "reward_score": score,
        "ref_logprob": ref,
        "actor_logprob": alp,
        "kl_div": KL(5, alp.result, ref.result, kl_estimator, kl_div),
        "loss": Apply(6, loss_fn, (score.result, kl_div), loss, loss_options),
    }
    assert ir.outputs == tuple(OUTPUTS) and ir.roles == frozenset(roles)
    assert ir.call("actor", "update") == ir.calls[-1] and ir.call("critic", "update") is None
    # Lowering reads only the IR: the same dataflow as compile_step.
    assert lower(ir) == compile_step(logic, ["prompt"], OUTPUTS, roles)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ir.calls[0].op = "train"  # type: ignore[misc]


def test_penalty_arith_and_alias_are_typed():
    logic = """
    response = actor.generate(prompt)
    reward_score = reward.score(prompt, response)
    ref_logprob = ref.get_logprob(prompt, response)
    actor_logprob = actor.get_logprob(prompt, response)
    kl_div = actor_logprob - ref_logprob
    shaped = reward_score - 0.05 * kl_div
    bonus = 2 * shaped + 1
    again = bonus
    loss = ppo_loss(again)
    actor.update(loss)
    """
    ir = analyze(logic, ["prompt"], ["loss"], ALL)
    v = ir.values
    assert ir.assigns["shaped"] == Penalty(6, v["reward_score"], v["kl_div"], 0.05, v["shaped"])
    assert ir.assigns["bonus"] == Arith(7, "2 * shaped + 1", (v["shaped"],), False, v["bonus"])
    assert ir.assigns["again"] == Alias(8, v["bonus"], Value("again", "score", 8))
    assert ir.resolve(v["again"]) == v["bonus"]
    assert ir.definition(PROMPT) is None


def test_compiler_modules_import_each_other_without_a_cycle():
    root = Path(compile_step.__code__.co_filename).parent  # pipeline/compiler/
    modules = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for m in modules:
        tree = ast.parse((root / f"{m}.py").read_text())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("hybridflow.pipeline.compiler."):
                    deps.add(node.module.rsplit(".", 1)[1])
                elif node.module == "hybridflow.pipeline.compiler":
                    deps |= {a.name for a in node.names}
        graph[m] = deps & modules
    assert "frontend" not in graph["lowering"] and graph["ir"] == set()
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, f"import cycle: {' -> '.join((*path, m))}"
        if m not in done:
            for d in graph[m]:
                visit(d, (*path, m))
            done.add(m)

    for m in graph:
        visit(m, ())

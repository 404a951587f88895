"""THE advantage-estimator table (hybridflow.algos.ADVANTAGE_ESTIMATORS): every estimator
named once, and every layer that derives from it (the `advantages` driver op, the
step-logic compiler) agrees with it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import hybridflow
from hybridflow.algos import ADVANTAGE_ESTIMATORS, EstimatorSpec
from hybridflow.config.schema import load_topology
from hybridflow.pipeline.compiler.frontend import compile_step
from hybridflow.pipeline.compiler.grammar import ALGORITHMS, ESTIMATOR_OPTIONS
from hybridflow.pipeline.driver.rl_ops import AdvantageParams, Advantages

ALL = ["actor", "rollout", "reference", "critic", "reward"]


def test_every_estimator_is_named_once():
    assert all(isinstance(s, EstimatorSpec) for s in ADVANTAGE_ESTIMATORS.values())
    assert all(name == s.name for name, s in ADVANTAGE_ESTIMATORS.items())
    assert all(s.doc and callable(s.fn) for s in ADVANTAGE_ESTIMATORS.values())
    # Estimators no code path defaults to appear as a literal only in hybridflow.algos
    # (the table's owner): nobody writes a second table of them.
    root = Path(hybridflow.__file__).parent
    for name in ("rloo", "reinforce_pp_baseline"):
        hits = [
            p.relative_to(root)
            for p in root.rglob("*.py")
            if p.parent != root / "algos"
            and (f'"{name}"' in p.read_text() or f"'{name}'" in p.read_text())
        ]
        assert hits == [], f"{name!r} is spelled out outside the estimator table: {hits}"


def test_the_flags_follow_the_inputs():
    for s in ADVANTAGE_ESTIMATORS.values():
        assert s.needs_values == ("values" in s.inputs) == s.needs_critic, s.name
        assert s.needs_groups == ("group_index" in s.inputs), s.name


def test_the_driver_op_params_cover_every_option():
    fields = {f.name for f in dataclasses.fields(AdvantageParams)}
    for s in ADVANTAGE_ESTIMATORS.values():
        assert set(s.options) <= fields, s.name


def test_the_logic_language_has_one_function_per_estimator():
    produced = {n for n, a in ALGORITHMS.items() if a.result == "advantages"}
    assert produced == set(ADVANTAGE_ESTIMATORS)
    for name, s in ADVANTAGE_ESTIMATORS.items():
        algo = ALGORITHMS[name]
        assert algo.options == s.options and algo.doc == s.doc
        assert algo.args == ((("score", "values"),) if s.needs_values else (("score",),))
    assert set(ESTIMATOR_OPTIONS) == {o for s in ADVANTAGE_ESTIMATORS.values() for o in s.options}
    assert set(ESTIMATOR_OPTIONS) <= set(ALGORITHMS["ppo_loss"].options)


@pytest.mark.parametrize("name", list(ADVANTAGE_ESTIMATORS))
def test_compiled_ops_and_the_driver_op_agree_with_the_table(name):
    spec = ADVANTAGE_ESTIMATORS[name]
    logic = f"""
    response = actor.generate(prompt, n=4)
    reward_score = reward.score(prompt, response)
    loss = ppo_loss(reward_score, estimator={name!r})
    actor.update(loss)
    """
    cs = compile_step(logic, ["prompt"], ["loss"], ALL)
    index, adv = next((i, op) for i, op in enumerate(cs.dataflow) if op.op == "advantages")
    assert adv.params["estimator"] == name
    assert set(adv.params) - {"estimator"} <= set(spec.options)
    assert ("group_index" in adv.inputs) == spec.needs_groups == ("group_index" in cs.data_fields)
    assert ("values" in adv.inputs) == spec.needs_values
    assert cs.dataflow[0].op == "generate"
    assert any(op.label == "critic.update" for op in cs.dataflow) == spec.needs_values
    # The driver op accepts what the compiler wrote (inputs, outputs, options, groups).
    preset = load_topology("grpo")
    data = dataclasses.replace(
        preset.data, fields=cs.data_fields, options={**preset.data.options, "samples_per_prompt": 4}
    )
    op = Advantages(dataclasses.replace(preset, dataflow=cs.dataflow, data=data), index)
    assert op.spec is spec
    assert set(op.options) == set(spec.options)
    if spec.returns:  # an estimator with returns may declare them
        with_returns = dataclasses.replace(adv, outputs=("advantages", "returns"))
        ops = list(cs.dataflow)
        ops[index] = with_returns
        Advantages(dataclasses.replace(preset, dataflow=tuple(ops), data=data), index)

"""One source of advantage defaults: hybridflow.algos.EstimatorOptions. The estimator
functions, the `advantages` driver op's params (a YAML topology that leaves an option
out) and a compiled step logic (the Python API) all run with its values."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from hybridflow.algos import ADVANTAGE_ESTIMATORS, EstimatorOptions, gae, grpo_advantages
from hybridflow.algos.advantages import reinforce_pp
from hybridflow.config.loader import from_dict
from hybridflow.pipeline.compiler.frontend import compile_step
from hybridflow.pipeline.driver.rl_ops import AdvantageParams

ALL = ["actor", "rollout", "reference", "critic", "reward"]
DEFAULTS = EstimatorOptions()


def test_the_options_are_the_estimators_options():
    fields = {f.name for f in dataclasses.fields(EstimatorOptions)}
    assert fields == {o for s in ADVANTAGE_ESTIMATORS.values() for o in s.options}
    assert issubclass(AdvantageParams, EstimatorOptions)


def test_the_functions_default_to_the_table():
    checked = set()
    for fn in (gae, grpo_advantages, reinforce_pp):
        for name, param in inspect.signature(fn).parameters.items():
            if hasattr(DEFAULTS, name):
                assert param.default == getattr(DEFAULTS, name), (fn.__name__, name)
                checked.add(name)
    # every option is some function's keyword (a renamed one would be skipped in silence)
    assert checked == {f.name for f in dataclasses.fields(EstimatorOptions)}
    assert DEFAULTS.lam == 1.0 and DEFAULTS.gamma == 1.0  # verl's algorithm.lam / gamma


@pytest.mark.parametrize(
    ("loss", "estimator"),
    [("ppo_loss(reward_score)", "gae"), ("grpo_loss(reward_score)", "grpo")],
)
def test_yaml_and_compiled_logic_run_with_the_same_defaults(loss, estimator):
    logic = f"""
    response = actor.generate(prompt, n=4)
    reward_score = reward.score(prompt, response)
    loss = {loss}
    actor.update(loss)
    """
    cs = compile_step(logic, ["prompt"], ["loss"], ALL)
    compiled = next(op for op in cs.dataflow if op.op == "advantages").params
    assert compiled["estimator"] == estimator
    python_path = from_dict(AdvantageParams, dict(compiled), "params")
    yaml_path = from_dict(AdvantageParams, {"estimator": estimator}, "params")  # nothing set
    assert python_path == yaml_path
    for option in ADVANTAGE_ESTIMATORS[estimator].options:
        assert getattr(yaml_path, option) == getattr(DEFAULTS, option)

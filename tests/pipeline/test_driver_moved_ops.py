"""Driver ops saved under a module's old name still resolve (driver/registry.py `MOVED`).

A checkpoint's meta.json (and a run's topology file) holds the topology as the step-logic
compiler wrote it, op names included; the runtime arithmetic was written as
`hybridflow.pipeline.compiler.expr:*` until it moved to `pipeline/driver/expr.py`
(issue 26). Resuming such a topology plans it and resolves its ops by those names."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config.loader import to_dict
from hybridflow.config.schema import load_topology
from hybridflow.errors import ConfigError
from hybridflow.pipeline.compiler.frontend import compile_step
from hybridflow.pipeline.driver import expr
from hybridflow.pipeline.driver.registry import current_target, resolve_driver_op
from hybridflow.pipeline.plan.planner import build_plan

OLD = "hybridflow.pipeline.compiler.expr"
LOGIC = """
response = actor.generate(prompt)
reward_score = reward.score(prompt, response)
ref_logprob = ref.get_logprob(prompt, response)
bonus = 2 * reward_score + 1
loss = ppo_loss(bonus)
actor.update(loss)
"""


def _saved_before_the_move() -> dict:
    """The grpo preset running LOGIC, as a topology saved before the move names its ops."""
    roles = ["actor", "rollout", "reward", "reference"]
    compiled = compile_step(LOGIC, ["prompt"], ["loss", "bonus"], roles)
    data = to_dict(load_topology("grpo"))
    data["dataflow"] = [to_dict(op) for op in compiled.dataflow]
    for op in data["dataflow"]:
        op["op"] = op["op"].replace("hybridflow.pipeline.driver.expr", OLD)
    assert sum(op["op"].startswith(OLD) for op in data["dataflow"]) == 2  # arith, ScoreAdv.
    return data


def test_an_op_named_by_its_old_module_resolves_to_the_moved_one():
    fn = resolve_driver_op(f"{OLD}:arith", "dataflow[3].op")
    assert fn is expr.arith
    out, _ = fn({"rewards": torch.tensor([0.0, 0.5])}, {"expr": "2 * rewards", "output": "x"})
    assert torch.equal(out["x"], torch.tensor([0.0, 1.0]))
    assert current_target(f"{OLD}:ScoreAdvantages") == (
        "hybridflow.pipeline.driver.expr:ScoreAdvantages"
    )
    assert current_target("pkg.compiler.expr:arith") == "pkg.compiler.expr:arith"  # not ours
    with pytest.raises(ConfigError, match=r"dataflow\[3\]\.op: .*nope"):
        resolve_driver_op(f"{OLD}:nope", "dataflow[3].op")  # the attribute is still checked


def test_a_topology_saved_before_the_move_plans_and_builds_its_ops():
    topo = load_topology(_saved_before_the_move())
    plan = build_plan(topo, check_data=False)  # resolves every driver op, classes built
    driver = [op for op in plan.ops if op.cfg.role == "driver"]
    assert [op.cfg.op for op in driver] == [f"{OLD}:arith", f"{OLD}:ScoreAdvantages"]
    built = resolve_driver_op(driver[1].cfg.op, "", topology=topo, index=driver[1].index)
    assert isinstance(built, expr.ScoreAdvantages)

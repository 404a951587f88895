"""`outline(plan)`: one step in order, who waits for whom, where the reshard happens
(pipeline/plan/step.py), and `hybridflow validate` printing it. Here beside the
disaggregated topology it reads (ws_helpers)."""

from __future__ import annotations

from ws_helpers import disaggregated

from hybridflow.cli import main
from hybridflow.config.schema import load_topology
from hybridflow.pipeline.plan.planner import build_plan
from hybridflow.pipeline.plan.step import outline


def _rows(lines: list[str]) -> dict[str, str]:
    """op label -> the rest of its line."""
    out = {}
    for ln in lines:
        if ln.startswith("    ["):
            label, rest = ln.split("]", 1)[1].split(None, 1)
            out[label] = rest
    return out


def test_the_grpo_step_reads_in_order_with_its_waits_and_the_reshard():
    lines = outline(build_plan(load_topology("grpo")))
    assert lines[0].startswith("one step: 4 micro-batch(es) of 32 rows, streamed")
    rows = _rows(lines)
    assert list(rows) == [
        "rollout.generate", "reward.score", "reference.get_logprob", "driver.advantages",
        "actor.update", "actor.optimizer_step", "actor.reshard",
    ]  # fmt: skip
    assert rows["rollout.generate"].endswith("waits for: the step's data")
    assert "on coordinator" in rows["driver.advantages"]
    assert rows["driver.advantages"].endswith("waits for: [0] [1] of m")
    assert rows["actor.update"].endswith("waits for: [0] [2] [3] of m")
    assert "waits for: every op before it" in rows["actor.optimizer_step"]
    assert rows["actor.reshard"].endswith(
        "<- the hybrid reshard: training weights -> the rollout engine"
    )
    assert lines.index("  the step barrier: the ops above, for every micro-batch; then") == 7
    assert (
        lines[-1]
        == "  the next step's heads ([0]) start after this step's last op (run.max_offpolicy_steps 0)"
    )


def test_a_weight_link_runs_both_ends_together_and_off_policy_heads_run_ahead(tmp_path):
    topo = load_topology(disaggregated(tmp_path, k=1))
    lines = outline(build_plan(topo))
    rows = _rows(lines)
    reshard = next(i for i, op in enumerate(topo.dataflow) if op.op == "reshard")
    load = next(i for i, op in enumerate(topo.dataflow) if op.op == "load_weights")
    assert (
        f"every op before it but [{reshard}] (the other end of its weight link"
        in rows[topo.dataflow[load].label]
    )
    assert lines[-1].endswith("start up to 1 step(s) ahead of it (run.max_offpolicy_steps 1)")


def test_validate_prints_the_step(capsys):
    assert main(["validate", "ppo"]) == 0
    out = capsys.readouterr().out
    assert "one step: " in out and "[9] actor.reshard" in out and "<- the hybrid reshard" in out

"""The algorithm presets end to end: `dapo` and `gspo` validate, the step logic that says
what each does compiles to its dataflow and options, the advantages op's DAPO params are
checked with their key, and `dapo`, shrunk, learns the built-in task over real processes.

DAPO here: clip-higher, token-mean loss, overlong shaping and dynamic sampling's filter
(groups whose rewards all agree leave the loss through `sample_mask`; no refill). From
a random-init tiny model the mean task reward of the last steps must clearly beat the
first steps, and the dynamic-sampling / shaping metrics are written every step.
Margins are generous and nothing here asserts time.
"""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import mean, preset, read_jsonl

from hybridflow.cli import main
from hybridflow.config.schema import load_topology
from hybridflow.errors import CompileError, ConfigError
from hybridflow.pipeline.compiler.frontend import compile_step
from hybridflow.pipeline.driver.registry import resolve_driver_op
from hybridflow.pipeline.plan.planner import build_plan
from hybridflow.pipeline.runtime.runner import run_topology

DAPO = """
response = actor.generate(prompt, n=8, max_new_tokens=4)
reward_score = reward.score(prompt, response)
loss = grpo_loss(reward_score, clip_ratio_high=0.28, dynamic_sampling=True,
                 overlong_max_len=4, overlong_buffer_len=2, overlong_penalty_factor=0.5)
actor.update(loss)
"""

GSPO = """
response = actor.generate(prompt, n=8)
reward_score = reward.score(prompt, response)
ref_logprob = ref.get_logprob(prompt, response)
actor_logprob = actor.get_logprob(prompt, response)
kl_div = kl(actor_logprob, ref_logprob, kind="k3")
loss = grpo_loss(reward_score, kl_div, kl_coef=0.01, policy_loss="gspo",
                 loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4, clip_ratio_high=4e-4)
actor.update(loss)
"""


@pytest.mark.parametrize("name", ["dapo", "gspo"])
def test_algorithm_presets_validate(name, capsys):
    assert main(["validate", name]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("ok")
    assert "driver.advantages(" in out


@pytest.mark.parametrize(
    ("name", "logic", "roles"),
    [
        ("dapo", DAPO, ["actor", "rollout", "reward"]),
        ("gspo", GSPO, ["actor", "rollout", "reference", "reward"]),
    ],
)
def test_logic_compiles_to_the_preset(name, logic, roles):
    topo = load_topology(name)
    cs = compile_step(logic, ["prompt"], ["loss"], roles)
    assert cs.dataflow == topo.dataflow
    actor = topo.stages["engine"].roles["actor"].options
    for key, value in cs.role_options["actor"].items():
        assert actor[key] == value, key
    build_plan(topo)


def test_logic_algorithm_options():
    base = DAPO.replace("clip_ratio_high=0.28, ", "")
    cs = compile_step(
        base.replace("dynamic_sampling=True", "policy_loss='cispo'"),
        ["prompt"],
        [],
        ["actor", "rollout", "reward"],
    )
    assert cs.role_options["actor"]["policy_loss"] == "cispo"
    assert all("sample_mask" not in op.outputs for op in cs.dataflow)
    dr = GSPO.replace('policy_loss="gspo"', 'estimator="dr_grpo"').replace(
        '"seq-mean-token-mean"', '"seq-mean-token-sum-norm", loss_norm_len=4'
    )
    cs = compile_step(dr, ["prompt"], [], ["actor", "rollout", "reference", "reward"])
    adv = next(op for op in cs.dataflow if op.op == "advantages")
    assert adv.params["estimator"] == "dr_grpo"
    assert cs.role_options["actor"]["loss_norm_len"] == 4
    plus = GSPO.replace('kind="k3"', 'kind="k1+"')
    cs = compile_step(plus, ["prompt"], [], ["actor", "rollout", "reference", "reward"])
    assert cs.role_options["actor"]["kl_loss_type"] == "k1+"
    with pytest.raises(CompileError, match="dynamic_sampling= drops groups"):
        compile_step(
            "response = actor.generate(prompt)\ns = reward.score(prompt, response)\n"
            "loss = ppo_loss(s, estimator='reinforce_pp', dynamic_sampling=True)\nactor.update(loss)",
            ["prompt"], [], ["actor", "rollout", "reward"],
        )  # fmt: skip


def _adv_index(topo) -> int:
    return next(i for i, op in enumerate(topo.dataflow) if op.op == "advantages")


def test_dapo_params_are_checked_with_their_key():
    topo = load_topology("dapo")
    i = _adv_index(topo)
    upd = next(j for j, op in enumerate(topo.dataflow) if op.op == "update")
    bad = {
        "overlong_max_len=1": "overlong_max_len",
        "estimator=reinforce_pp": "dynamic_sampling",
    }
    for override, key in bad.items():
        with pytest.raises(ConfigError, match=rf"^dataflow\[{i}\]\.params\.{key}"):
            build_plan(load_topology("dapo", [f"dataflow.{i}.params.{override}"]))
    with pytest.raises(ConfigError, match="sample_mask"):  # the topology itself refuses it
        build_plan(load_topology("dapo", [f"dataflow.{i}.outputs=[advantages]"]))
    no_input = topo.dataflow[upd].inputs[:-1]
    with pytest.raises(ConfigError, match=r"actor\.update must read `sample_mask`"):
        build_plan(load_topology("dapo", [f"dataflow.{upd}.inputs=[{', '.join(no_input)}]"]))


def test_dapo_advantages_op_filters_and_shapes():
    topo = load_topology("dapo", ["run.micro_batch=32"])
    op = resolve_driver_op("advantages", "x", topology=topo, index=_adv_index(topo))
    groups = torch.arange(4).repeat_interleave(8)  # 4 prompts x 8 samples
    rewards = torch.rand(32, generator=torch.Generator().manual_seed(0))
    rewards[groups == 1] = 0.0  # all wrong
    rewards[groups == 2] = 1.0  # all right
    lengths = torch.tensor([1, 2, 3, 4] * 8)
    mask = (torch.arange(4) < lengths.unsqueeze(-1)).long()
    batch = {"rewards": rewards, "response_mask": mask, "group_index": groups,
             "prompt_mask": torch.ones(32, 5, dtype=torch.long)}  # fmt: skip
    out, m = op(batch, {"step": 0})
    keep = (groups == 0) | (groups == 3)
    assert torch.equal(out["sample_mask"], keep.float())
    assert bool((out["advantages"][~keep] == 0).all())
    assert m["dynamic_sampling/kept_groups_count"] == 2.0
    assert m["dynamic_sampling/dropped_groups_count"] == 2.0
    assert m["dynamic_sampling/kept_frac"] == 0.5
    # lengths 3, 4 of max 4 with a buffer of 2: penalties -0.25, -0.5 (factor 0.5)
    assert m["reward/overlong_penalty"] == pytest.approx((0 + 0 - 0.25 - 0.5) / 4)
    assert m["reward/overlong_frac"] == 0.5
    assert m["reward/mean"] == pytest.approx(float(rewards.mean()))  # the task reward


def test_dapo_keeps_a_train_batch_of_whole_informative_groups_over_the_step():
    """`dynamic_sampling_keep` with `scope: step`: the first informative groups (data order)
    that fit in the limit are trained on, never part of a group; the shortfall is counted.
    Without `scope: step`, or without dynamic_sampling, the plan refuses it by key."""
    i = _adv_index(load_topology("dapo"))
    groups = torch.arange(4).repeat_interleave(8)  # 4 prompts x 8 samples
    rewards = torch.rand(32, generator=torch.Generator().manual_seed(0))
    rewards[groups == 1] = 0.0  # uninformative: all wrong
    batch = {"rewards": rewards, "response_mask": torch.ones(32, 4, dtype=torch.long),
             "group_index": groups, "prompt_mask": torch.ones(32, 5, dtype=torch.long)}  # fmt: skip
    for limit, kept, short in ((16, [0, 2], 0), (20, [0, 2], 4), (8, [0], 0), (7, [], 7)):
        topo = load_topology(
            "dapo",
            [f"dataflow[{i}].scope=step", f"dataflow[{i}].params.dynamic_sampling_keep={limit}"],
        )
        op = resolve_driver_op("advantages", "x", topology=topo, index=i)
        out, m = op(batch, {"step": 0})
        want = torch.isin(groups, torch.tensor(kept, dtype=torch.long))
        assert torch.equal(out["sample_mask"], want.float()), limit
        assert m["dynamic_sampling/short_count"] == short
        assert m["dynamic_sampling/kept_groups_count"] == len(kept)
    with pytest.raises(
        ConfigError, match=rf"^dataflow\[{i}\]\.params\.dynamic_sampling_keep: counts"
    ):
        build_plan(load_topology("dapo", [f"dataflow[{i}].params.dynamic_sampling_keep=16"]))
    with pytest.raises(ConfigError, match=r"dynamic_sampling_keep: caps what dynamic_sampling"):
        build_plan(
            load_topology(
                "dapo",
                [f"dataflow[{i}].scope=step", f"dataflow[{i}].params.dynamic_sampling_keep=16",
                 f"dataflow[{i}].params.dynamic_sampling=false"],
            )
        )  # fmt: skip


def test_dapo_reward_rises_and_its_metrics_are_written(tmp_path):
    run_dir = tmp_path / "dapo"
    topo = preset(
        "dapo",
        run_dir,
        "run.steps=14",
        "run.step_batch=64",  # 8 prompts x 8 samples
        "run.micro_batch=32",
        "stages.engine.roles.actor.options.lr=0.01",
    )
    run_topology(topo)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(14))
    for row in rows:
        for key in (
            "dynamic_sampling/kept_groups_count",
            "dynamic_sampling/dropped_groups_count",
            "dynamic_sampling/kept_frac",
            "reward/overlong_penalty",
            "reward/overlong_frac",
        ):
            assert isinstance(row.get(key), (int, float)), f"step {row['step']} lacks {key}"
        # 8 groups per step, every one either kept or dropped
        groups = (
            row["dynamic_sampling/kept_groups_count"] + row["dynamic_sampling/dropped_groups_count"]
        )
        assert groups == 8
        assert 0.0 <= row["dynamic_sampling/kept_frac"] <= 1.0
        assert -0.5 <= row["reward/overlong_penalty"] <= 0.0
    first, last = mean(rows[:3], "reward/mean"), mean(rows[-3:], "reward/mean")
    history = [round(r["reward/mean"], 3) for r in rows]
    assert first < 0.15 and last > 2 * first + 0.1, history

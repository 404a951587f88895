"""The RL presets and their plan-time checks (no processes): presets validate, the
`advantages` driver op rejects bad settings with the dotted key, the `prompts` source
lays steps out in groups, the KL coefficient follows its deterministic schedule, and the
derived metrics / plot / summary behave."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hybridflow.cli import main
from hybridflow.config.schema import load_topology
from hybridflow.errors import ConfigError
from hybridflow.pipeline.driver.registry import resolve_driver_op
from hybridflow.pipeline.observe.metrics import derive_step_metrics
from hybridflow.pipeline.observe.plot import plot_run, reward_summary
from hybridflow.pipeline.plan.planner import build_plan
from hybridflow.pipeline.sources.rl import GroupedPrompts

RL_PRESETS = ("grpo", "ppo", "demo")


@pytest.mark.parametrize("name", RL_PRESETS)
def test_rl_presets_validate(name, capsys):
    assert main(["validate", name]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("ok")
    assert "driver.advantages(" in out and "on coordinator" in out
    assert "engine/0  device cpu     roles: rollout (hf), actor (hf), reference (hf)" in out


def _adv_index(topo) -> int:
    return next(i for i, op in enumerate(topo.dataflow) if op.op == "advantages")


def test_group_estimator_needs_whole_groups_in_a_micro_batch():
    with pytest.raises(ConfigError) as info:
        build_plan(load_topology("grpo", ["run.micro_batch=4"]))
    msg = str(info.value)
    assert msg.startswith(
        "run.micro_batch: 4 is not a multiple of data.options.samples_per_prompt (8)"
    )
    assert "use one of 8, 16, 32" in msg
    # over the whole step (scope: step) the groups meet in one call whatever the micro-batch
    i = _adv_index(load_topology("grpo"))
    build_plan(load_topology("grpo", ["run.micro_batch=4", f"dataflow[{i}].scope=step"]))


def test_group_estimator_needs_two_samples_per_prompt():
    with pytest.raises(ConfigError, match=r"^data.options.samples_per_prompt: .* needs >= 2"):
        build_plan(load_topology("grpo", ["data.options.samples_per_prompt=1"]))


def test_advantage_params_are_checked_with_their_key():
    topo = load_topology("ppo")
    i = _adv_index(topo)
    with pytest.raises(ConfigError, match=rf"^dataflow\[{i}\]\.params\.estimator: unknown"):
        build_plan(load_topology("ppo", [f"dataflow.{i}.params.estimator=gea"]))
    with pytest.raises(ConfigError, match=rf"^dataflow\[{i}\]\.params\.kl_penalty: must be"):
        build_plan(load_topology("ppo", [f"dataflow.{i}.params.kl_penalty=k9"]))
    with pytest.raises(ConfigError, match=rf"^dataflow\[{i}\]\.params\.lamda: unknown key"):
        build_plan(load_topology("ppo", [f"dataflow.{i}.params.lamda=0.9"]))


def test_gae_without_values_is_a_config_error():
    topo = load_topology("ppo")
    i = _adv_index(topo)
    inputs = [n for n in topo.dataflow[i].inputs if n != "values"]
    with pytest.raises(ConfigError) as info:
        build_plan(load_topology("ppo", [f"dataflow.{i}.inputs=[{', '.join(inputs)}]"]))
    assert str(info.value).startswith(f"dataflow[{i}].inputs: estimator 'gae' with kl_penalty")
    assert "missing ['values']" in str(info.value)


def _sequences(rewards: list[float], lengths: list[int]) -> dict[str, torch.Tensor]:
    width = max(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"rewards": torch.tensor(rewards), "response_mask": mask}


def test_grpo_op_matches_the_algorithm_and_reports_reward_stats():
    topo = load_topology("grpo")
    op = resolve_driver_op("advantages", "", topology=topo, index=_adv_index(topo))
    batch = _sequences([1.0, 0.0, 0.5, 0.5], [1, 2, 2, 1])
    batch["group_index"] = torch.tensor([3, 3, 4, 4])
    batch["prompt_mask"] = torch.ones(4, 5, dtype=torch.long)
    out, m = op(batch, {"step": 0, "mb_id": 0, "policy_version": 0})
    adv = out["advantages"]
    s = 0.5 / (math.sqrt(0.5) + 1e-6)  # (1 - mean 0.5) / (unbiased std 0.707 + eps)
    assert torch.allclose(
        adv, torch.tensor([[s, 0.0], [-s, -s], [0.0, 0.0], [0.0, 0.0]]), atol=1e-4
    )
    assert m["reward/mean"] == 0.5 and m["response_length/mean"] == 1.5
    assert m["prompt_length/mean"] == 5.0
    derive_step_metrics(m, step_batch=4)
    assert "reward/sq_mean" not in m and math.isclose(m["reward/std"], math.sqrt(0.125))


def test_adaptive_kl_coefficient_follows_finished_steps_only():
    topo = load_topology("ppo", ["run.step_batch=64", "run.micro_batch=32"])  # 2 mbs a step
    op = resolve_driver_op("advantages", "", topology=topo, index=_adv_index(topo))
    b = _sequences([1.0, 0.0], [2, 2])
    b["values"] = torch.zeros(2, 2)
    b["rollout_logprobs"] = torch.full((2, 2), -1.0)
    b["ref_logprobs"] = torch.full((2, 2), -2.0)  # k1 = 1.0 per token, 10x the target 0.1
    coefs = []
    for step in range(3):
        for mb in range(2):
            _, m = op(dict(b), {"step": step, "mb_id": mb, "policy_version": step})
            coefs.append(m["actor/kl_coef"])
            assert m["reward/kl"] == 1.0
    # fixed within a step; after each step (4 samples seen) *= 1 + 0.2 * 4 / 10000
    # (KL error clipped at +0.2)
    grow = 1 + 0.2 * 4 / 10000
    want = [0.05, 0.05, 0.05 * grow, 0.05 * grow, 0.05 * grow**2, 0.05 * grow**2]
    assert all(math.isclose(a, w, rel_tol=1e-9) for a, w in zip(coefs, want, strict=True))


def test_prompts_source_repeats_each_prompt_for_its_group():
    opts = {"source": "task:last_digit", "tokenizer": "builtin", "samples_per_prompt": 4}
    fields = ("prompt_ids", "prompt_mask", "metadata_json", "group_index", "sample_idx")
    src = GroupedPrompts(fields, opts, seed=0)
    b = src.batch(2, 16)  # 4 prompts x 4 samples
    assert b["group_index"].tolist() == [8] * 4 + [9] * 4 + [10] * 4 + [11] * 4
    assert b["sample_idx"].tolist() == list(range(32, 48))
    for g in range(4):
        rows = b["prompt_ids"][4 * g : 4 * g + 4]
        assert torch.equal(rows, rows[:1].expand(4, -1))
    # prompt k of the run does not depend on n: n=1 serves the same prompts in order
    one = GroupedPrompts(fields, {**opts, "samples_per_prompt": 1}, seed=0).batch(2, 4)
    assert torch.equal(one["prompt_ids"], b["prompt_ids"][::4])
    with pytest.raises(ConfigError, match=r"^data\.options\.samples_per_prompt: must be"):
        GroupedPrompts(fields, {**opts, "samples_per_prompt": 0}, seed=0)


def test_reward_summary_and_plot(tmp_path):
    rows = [
        {"step": float(s), "reward/mean": 0.1 + 0.01 * s, "reward/std": 0.1, "actor/kl": 0.001 * s}
        for s in range(30)
    ]
    summary = reward_summary(rows)
    assert summary is not None and summary.window == 3
    assert math.isclose(summary.first, 0.11) and math.isclose(summary.last, 0.38)
    path = plot_run(rows, tmp_path / "p.png", "t")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_run([{"step": 0.0}], tmp_path / "none.png") is None


def test_adaptive_kl_coefficient_of_a_resumed_run_starts_at_its_first_step():
    topo = load_topology("ppo", ["run.step_batch=32", "run.micro_batch=32"])  # 1 mb a step
    op = resolve_driver_op("advantages", "", topology=topo, index=_adv_index(topo))
    b = _sequences([1.0, 0.0], [2, 2])
    b["values"] = torch.zeros(2, 2)
    b["rollout_logprobs"] = torch.full((2, 2), -1.0)
    b["ref_logprobs"] = torch.full((2, 2), -1.0)  # KL 0: below target, coef shrinks
    coefs = [
        op(dict(b), {"step": s, "mb_id": 0, "policy_version": s})[1]["actor/kl_coef"]
        for s in (7, 8)
    ]
    assert coefs[0] == 0.05 and math.isclose(coefs[1], 0.05 * (1 - 0.2 * 2 / 10000))


def test_adaptive_kl_schedule_survives_a_checkpoint_round_trip(tmp_path):
    from hybridflow.pipeline.checkpoint.checkpointer import load_drivers, save_drivers

    topo = load_topology("ppo", ["run.step_batch=32", "run.micro_batch=32"])  # 1 mb a step
    index = _adv_index(topo)
    b = _sequences([1.0, 0.0], [2, 2])
    b["values"] = torch.zeros(2, 2)
    b["rollout_logprobs"] = torch.full((2, 2), -1.0)
    b["ref_logprobs"] = torch.full((2, 2), -1.0)  # KL 0: below target, coef shrinks

    def coef(op, step):
        return op(dict(b), {"step": step, "mb_id": 0, "policy_version": step})[1]["actor/kl_coef"]

    unbroken = resolve_driver_op("advantages", "", topology=topo, index=index)
    want = [coef(unbroken, s) for s in range(4)]
    first = resolve_driver_op("advantages", "", topology=topo, index=index)
    for s in range(2):
        coef(first, s)
    save_drivers({index: first}, tmp_path)
    resumed = resolve_driver_op("advantages", "", topology=topo, index=index)
    load_drivers({index: resumed}, tmp_path)
    got = [coef(resumed, s) for s in (2, 3)]
    assert got == want[2:] and want[3] < want[2] < want[0]


def test_jsonl_sink_of_a_resumed_run_continues_the_file(tmp_path):
    from hybridflow.pipeline.observe.metrics import JsonlSink

    first = JsonlSink(tmp_path)
    for step in range(3):
        first.write(step, {"reward/mean": float(step)})
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "rew')  # a line cut by a crash during step 3
    resumed = JsonlSink(tmp_path, start_step=2)  # the checkpoint was after step 1
    for step in (2, 3):
        resumed.write(step, {"reward/mean": 10.0 + step})
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in rows] == [
        (0, 0.0),
        (1, 1.0),
        (2, 12.0),
        (3, 13.0),
    ]
    fresh = JsonlSink(tmp_path)  # a new run starts the file anew
    fresh.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""

"""End-to-end RL runs over real processes: the bundled `grpo` and `ppo` presets, shrunk.

GRPO: seeded, on the built-in last_digit task from a random-init tiny model, the mean
reward of the last steps must clearly beat the first steps (a random policy scores ~0.02;
in these 14 steps it learns to answer with a digit). Every metric the RL presets promise
is in metrics.jsonl, and the plot / TensorBoard files exist.
PPO: with a reward the critic can learn exactly (always 1.0), its value loss must fall.
A reward function that raises ends the run with an error naming it and the sample.
Margins are generous and nothing here asserts time.
"""

from __future__ import annotations

import math

import pytest
from e2e_helpers import mean, preset, read_jsonl

from hybridflow.errors import StageError
from hybridflow.pipeline.runtime.runner import run_topology

REQUIRED = (
    "reward/mean",
    "reward/std",
    "response_length/mean",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/entropy",
    "actor/kl",
    "actor/grad_norm",
    "actor/lr",
    "timing/rollout",
    "timing/reward",
    "timing/ref",
    "timing/adv",
    "timing/train",
    "timing/reshard",
    "timing/step",
    "perf/samples_per_s",
    "perf/tokens_per_s",
)
PPO_ONLY = ("critic/vf_loss", "critic/vf_clipfrac", "timing/values", "actor/kl_coef")


def test_grpo_reward_rises_and_every_metric_is_written(tmp_path, capsys):
    run_dir = tmp_path / "grpo"
    topo = preset(
        "grpo",
        run_dir,
        "run.steps=14",
        "run.step_batch=64",  # 8 prompts x 8 samples
        "run.micro_batch=32",
        "stages.engine.roles.actor.options.lr=0.01",
    )
    result = run_topology(topo)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(14))
    for row in rows:
        missing = [k for k in REQUIRED if not isinstance(row.get(k), (int, float))]
        assert not missing, f"step {row['step']} lacks {missing}"
    first, last = mean(rows[:3], "reward/mean"), mean(rows[-3:], "reward/mean")
    history = [round(r["reward/mean"], 3) for r in rows]
    assert first < 0.15 and last > 2 * first + 0.1, history
    assert rows[-1]["actor/kl"] > 0  # the policy moved away from the reference
    assert all(math.isclose(r["actor/lr"], 0.01) for r in rows)
    # every step's two micro-batches went out as one gang and decoded as one loop
    assert all(r["rollout/concurrent_calls"] == 2.0 for r in rows), rows
    assert rows == [{"step": int(m["step"]), **_plain(m)} for m in result.metrics]
    # the other sinks of the preset: plot, TensorBoard, console (with its summary)
    assert (run_dir / "plot.png").stat().st_size > 10_000
    assert list(run_dir.glob("events.out.tfevents.*"))
    out = capsys.readouterr().out
    assert "step   13" in out and "first 10% of steps" in out and str(run_dir / "plot.png") in out


def _plain(m: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in m.items() if k != "step"}


def test_ppo_value_loss_falls(tmp_path):
    run_dir = tmp_path / "ppo"
    topo = preset(
        "ppo",
        run_dir,
        "run.steps=8",
        "run.step_batch=32",
        "run.micro_batch=16",
        "metrics.backends=[jsonl]",
        "stages.reward.roles.reward.options.function=tests.e2e.reward_fns:always_one",
    )
    run_topology(topo)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    for row in rows:
        missing = [k for k in (*REQUIRED, *PPO_ONLY) if not isinstance(row.get(k), (int, float))]
        assert not missing, f"step {row['step']} lacks {missing}"
    losses = [round(r["critic/vf_loss"], 4) for r in rows]
    assert mean(rows[-2:], "critic/vf_loss") < 0.5 * mean(rows[:2], "critic/vf_loss"), losses
    assert all(r["reward/mean"] == 1.0 for r in rows)


def test_a_raising_reward_function_names_itself_and_the_sample(tmp_path):
    fn = "tests.e2e.reward_fns:fails_on_a_seven"
    topo = preset(
        "grpo",
        tmp_path / "bad",
        "run.steps=1",
        "run.step_batch=64",
        "run.micro_batch=32",
        "metrics.backends=[jsonl]",
        f"stages.reward.roles.reward.options.function={fn}",
    )
    with pytest.raises(StageError) as info:
        run_topology(topo)
    msg = str(info.value)
    assert "stage reward replica 0 failed in reward.score at step 0" in msg, msg
    assert f"reward function {fn} raised on sample" in msg, msg
    assert "(id last_digit-" in msg and "ValueError: cannot score prompt 'last:" in msg, msg


def test_demo_command_prints_its_verdict_and_writes_the_summary(tmp_path, capsys):
    import json

    from hybridflow.cli import main

    code = main(["demo", "--set", f"run_dir={tmp_path}", "--set", "run.steps=4"])
    record = json.loads((tmp_path / "summary.json").read_text())
    assert code == (0 if record["learned"] else 1)
    assert record["steps"] == 4 and record["window_steps"] == 1
    assert record["reward_first_10pct"] < 0.1  # a random-init policy
    assert math.isclose(
        record["ratio"], record["reward_last_10pct"] / record["reward_first_10pct"], rel_tol=1e-2
    )
    out = capsys.readouterr().out
    assert "hybridflow demo: GRPO on CPU" in out and "mean reward, first 10% of RL steps" in out
    assert str(tmp_path / "plot.png") in out and (tmp_path / "plot.png").exists()


def test_grpo_with_the_native_engine_learns_and_batches_micro_batches_together(tmp_path):
    """The `native` rollout backend in the hybrid engine: the same GRPO run as the hf one
    learns the same way, and its generate calls overlap (several micro-batches decode in
    one engine at once: the stage runs concurrent ops side by side)."""
    run_dir = tmp_path / "grpo-native"
    topo = preset(
        "grpo",
        run_dir,
        "run.steps=14",
        "run.step_batch=64",
        "run.micro_batch=16",  # 4 micro-batches a step, 2 in flight
        "metrics.backends=[jsonl]",
        "stages.engine.roles.rollout.backend=native",
        "stages.engine.roles.rollout.options.max_prompt_len=64",
        "stages.engine.roles.actor.options.lr=0.01",
    )
    run_topology(topo)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(14))
    first, last = mean(rows[:3], "reward/mean"), mean(rows[-3:], "reward/mean")
    history = [round(r["reward/mean"], 3) for r in rows]
    assert first < 0.15 and last > 2 * first + 0.1, history
    assert max(r["rollout/concurrent_calls"] for r in rows) > 1.0, history


def test_ppo_with_step_wide_advantages_whitens_over_the_whole_step(tmp_path):
    """`scope: step` on the advantages op: GAE runs once per step over every micro-batch,
    so its whitening is the step's (verl's), while actor.update still runs per
    micro-batch on its slice, cut back to that micro-batch's response width. The adaptive
    KL coefficient keeps moving with one call per step."""
    import torch

    from hybridflow.algos.utils import masked_mean
    from hybridflow.pipeline.runtime.scheduler import concat_rows

    topo = preset(
        "ppo",
        tmp_path / "ppo-step",
        "run.steps=3",
        "run.step_batch=16",
        "run.micro_batch=2",
        "metrics.backends=[memory]",
        "dataflow[4].scope=step",
        # long enough that some micro-batch ends early (seeded: step 2 has a narrower one)
        "stages.engine.roles.rollout.options.max_new_tokens=48",
    )
    assert topo.dataflow[4].op == "advantages"
    res = run_topology(topo, collect=("advantages", "response_mask"))
    widths = {m.shape[1] for got in res.collected.values() for m in got["response_mask"]}
    assert len(widths) > 1, f"no micro-batch of another width: {widths}; the cut is untested"
    for step, got in res.collected.items():
        (adv,) = got["advantages"]  # one step-wide value: [16, R_max]
        mask = concat_rows(got["response_mask"]).float()  # per micro-batch -> [16, R_max]
        assert adv.shape == mask.shape
        mean = masked_mean(adv, mask)
        var = masked_mean((adv - mean) ** 2, mask)
        assert abs(float(mean)) < 1e-4 and abs(float(var) - 1.0) < 0.05, (step, mean, var)
        # per micro-batch the means differ: this was not per-micro-batch whitening
        mb_means = [
            float(masked_mean(a, m.float()))
            for a, m in zip(adv.split(2), mask.split(2), strict=True)
        ]
        assert max(map(abs, mb_means)) > 1e-3, mb_means
        assert torch.isfinite(adv).all()
    coefs = [row["actor/kl_coef"] for row in res.metrics]
    assert len(set(coefs)) == len(coefs), coefs  # adaptive: a new value every step
    assert all(math.isfinite(row["actor/pg_loss"]) for row in res.metrics)


def _two_native_grpo_steps(run_dir, *engine_options: str) -> dict:
    """Two small GRPO steps with the native rollout; `engine_options` are `role.key=value`
    options of the engine stage's roles. Both steps must train. -> the roles' options."""
    topo = preset(
        "grpo",
        run_dir,
        "run.steps=2",
        "run.step_batch=32",
        "run.micro_batch=16",
        "metrics.backends=[jsonl]",
        "stages.engine.roles.rollout.backend=native",
        "stages.engine.roles.rollout.options.max_prompt_len=64",
        *(f"stages.engine.roles.{o.replace('.', '.options.', 1)}" for o in engine_options),
    )
    run_topology(topo)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0 for r in rows)
    return {name: role.options for name, role in topo.stages["engine"].roles.items()}


def test_grpo_with_fp32_lm_heads_in_a_bf16_rollout_and_the_actor(tmp_path):
    """`fp32_lm_head` through the config: the native rollout (bf16 weights) and the actor
    swap their heads for float32 ones over the same parameters, so the actor's reshard
    still fills the rollout by name and a step trains."""
    heads = (f"{r}.fp32_lm_head=true" for r in ("rollout", "actor", "reference"))
    options = _two_native_grpo_steps(tmp_path / "grpo-fp32-head", "rollout.dtype=bfloat16", *heads)
    assert all(o["fp32_lm_head"] is True for o in options.values())


@pytest.mark.parametrize("arch", ["tiny-qwen3", "tiny-mistral"])
def test_grpo_on_other_layouts_with_the_native_engine(tmp_path, arch):
    """Qwen3's layout (per-head q/k norms, head_dim apart from hidden / heads) and
    Mistral's through the whole loop: the native rollout decodes it, the actor trains it,
    and the reshard's completeness check sees every parameter arrive in the rollout."""
    models = (f"{r}.model={arch}" for r in ("rollout", "actor", "reference"))
    options = _two_native_grpo_steps(tmp_path / f"grpo-{arch}", *models)
    assert {o["model"] for o in options.values()} == {arch}

"""LoRA GRPO end to end (issue 24): the bundled `grpo-lora` preset, shrunk, over real
stage processes on the built-in last_digit task.

It learns (the mean reward of the last steps clearly beats the first: a random policy
scores ~0.02), with only the adapters trained (the checkpoint's weight shards hold
nothing else; the export is a PEFT adapter directory), and a run resumed from a middle
checkpoint repeats the uninterrupted run's metrics bit for bit (the rollout of the
resumed run gets the base with the adapters merged). Nothing here asserts time.
"""

from __future__ import annotations

import pytest
from e2e_helpers import mean, preset, read_jsonl

from hybridflow.pipeline.checkpoint.resume import resolve
from hybridflow.pipeline.runtime.runner import run_topology

pytest.importorskip("peft")

STEPS = 14
SHRINK = (
    f"run.steps={STEPS}",
    "run.step_batch=64",  # 8 prompts x 8 samples
    "run.micro_batch=32",
    "metrics.backends=[jsonl]",
    "checkpoint.save_interval=7",
    "checkpoint.keep_last=0",
)


def _deterministic(row):
    clock = ("timing/", "compute/", "perf/", "checkpoint/")
    return {k: v for k, v in row.items() if not k.startswith(clock) and not k.endswith("_s")}


@pytest.mark.slow  # three runs over stage processes
def test_lora_grpo_learns_trains_only_adapters_and_resumes_bit_exactly(tmp_path):
    whole = tmp_path / "whole"
    run_topology(preset("grpo-lora", whole, *SHRINK))
    rows = read_jsonl(whole / "metrics.jsonl")
    history = [round(r["reward/mean"], 3) for r in rows]
    first, last = mean(rows[:3], "reward/mean"), mean(rows[-3:], "reward/mean")
    assert first < 0.15 and last > 2 * first + 0.1, history
    assert rows[-1]["actor/kl"] > 0  # the adapters moved the policy off the shared base

    final = whole / "checkpoints" / f"step-{STEPS:08d}"
    from safetensors import safe_open

    (shard,) = (final / "shards").glob("engine.actor/*.safetensors")
    with safe_open(str(shard), "pt") as f:
        keys = list(f.keys())
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), keys[:4]
    assert (final / "policy" / "adapter_config.json").is_file()  # a PEFT adapter directory

    broken = tmp_path / "broken"
    run_topology(preset("grpo-lora", broken, *SHRINK, f"run.steps={STEPS // 2}"))
    middle = resolve("latest", broken / "checkpoints")
    run_topology(preset("grpo-lora", broken, *SHRINK), start_step=7, resume_dir=str(middle))
    got = [_deterministic(r) for r in read_jsonl(broken / "metrics.jsonl")]
    expected = [_deterministic(r) for r in rows]
    assert [r["step"] for r in got] == list(range(STEPS))
    assert got[7:] == expected[7:]

"""verl's RL data format through a run, a verl-signature reward, and the validation loop
(before training, every `interval`, after the last step), then `hybridflow eval` on the
run's checkpoint. Real stage processes, a tiny random-init model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_helpers import preset, read_jsonl

from hybridflow.data.tasks import TASKS
from hybridflow.pipeline.runtime.runner import run_topology

pytestmark = pytest.mark.slow


def _tokenizer_dir(tmp_path: Path) -> Path:
    """The built-in tokenizer with a chat template (the content alone), saved: verl's
    chat `prompt` messages need a template."""
    from hybridflow.models.tokenizer import builtin_tokenizer

    tok = builtin_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = tmp_path / "tok"
    tok.save_pretrained(out)
    return out


def _verl_records(n: int, seed: int, split: str) -> list[dict]:
    """last_digit prompts in verl's layout (data_source, chat prompt, ability,
    reward_model.ground_truth, extra_info with nested fields)."""
    out = []
    for i, rec in enumerate(TASKS["last_digit"].prompts(n, seed)):
        out.append(
            {
                "data_source": "test/last_digit",
                "prompt": [{"role": "user", "content": rec["prompt"]}],
                "ability": "copy",
                "reward_model": {"style": "rule", "ground_truth": rec["answer"]},
                "extra_info": {
                    "split": split,
                    "index": i,
                    "nested": {"tags": ["a", "b"], "depth": {"k": 1}},
                },
            }
        )
    return out


def _parquet(path: Path, records: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


@pytest.fixture()
def verl_job(tmp_path):
    tok = _tokenizer_dir(tmp_path)
    train = _parquet(tmp_path / "train.parquet", _verl_records(64, 0, "train"))
    test = _parquet(tmp_path / "test.parquet", _verl_records(12, 1, "test"))
    overrides = [
        "run.steps=3",
        "run.step_batch=16",
        "run.micro_batch=8",
        "data.options.samples_per_prompt=4",
        f"data.options.source={train}",
        f"data.options.tokenizer={tok}",
        "data.options.max_prompt_length=32",
        f"stages.engine.roles.rollout.options.tokenizer={tok}",
        f"stages.engine.roles.actor.options.tokenizer={tok}",
        f"stages.engine.roles.reference.options.tokenizer={tok}",
        "stages.reward.roles.reward.options.function=tests.e2e.reward_fns:verl_last_digit",
        f"stages.reward.roles.reward.options.tokenizer={tok}",
        "metrics.backends=[jsonl]",
        f"validation.source={test}",
        "validation.interval=2",
        "validation.n=3",
        "validation.temperature=1.0",
        "validation.micro_batch=6",
        "validation.generations=2",
        "checkpoint.save_interval=0",
    ]
    return tmp_path, overrides


def test_verl_data_reward_validation_rows_and_eval_on_the_checkpoint(verl_job):
    tmp_path, overrides = verl_job
    run_dir = tmp_path / "run"
    topo = preset("grpo", run_dir, *overrides)
    result = run_topology(topo)

    assert [r["step"] for r in result.validation] == [0, 2, 3]  # before, interval, after
    rows = read_jsonl(run_dir / "metrics.jsonl")
    val = [r for r in rows if "val/reward/mean" in r]
    train = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in val] == [0, 2, 3] and [r["step"] for r in train] == [0, 1, 2]
    for r in val:
        for key in ("acc/mean", "acc/mean@3", "acc/best@3", "acc/maj@3", "digit/mean"):
            assert f"val/test/last_digit/{key}" in r, sorted(r)
        assert r["val/test/last_digit/acc/best@3"] >= r["val/test/last_digit/acc/mean@3"]
        assert r["val/response_length/mean"] > 0
    # The dict's extra numeric keys are training metrics too (mean over the step).
    assert all(0.0 <= r["reward/acc"] <= 1.0 and "reward/digit" in r for r in train)
    assert all(r["reward/fn_failures"] == 0 for r in train)

    gens = read_jsonl(run_dir / "val_generations.jsonl")
    assert [g["step"] for g in gens] == [0, 0, 2, 2, 3, 3]
    first = gens[0]
    assert first["prompt"].startswith("last:") and first["data_source"] == "test/last_digit"
    assert first["ground_truth"] == first["prompt"].rstrip("=")[-1]
    assert first["acc"] == float(first["pred"] == first["ground_truth"])
    # samples.jsonl (metrics.samples_per_step, 4): the scorer's fields reach the training
    # samples too, though the dataflow's score op declares `rewards` alone.
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert [(s["split"], s["step"]) for s in samples] == [("val", 0)] * 4 + [("train", 0)] * 4 + [
        ("train", 1)
    ] * 4 + [("val", 2)] * 4 + [("train", 2)] * 4 + [("val", 3)] * 4
    for s in samples:
        assert s["data_source"] == "test/last_digit" and s["acc"] == float(
            s["pred"] == s["ground_truth"]
        )

    # `hybridflow eval` on the final checkpoint: the same policy, prompts and sampling
    # seeds (from (seed, job step, micro-batch)), so the same scores as the run's own
    # last validation, sampled at temperature 1.
    sets = [a for o in [f"run_dir={run_dir}", *overrides] for a in ("--set", o)]
    out = subprocess.run(
        [sys.executable, "-m", "hybridflow", "eval", "grpo", *sets, "--checkpoint", "latest"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    evaluated = json.loads(out.stdout)
    assert evaluated["step"] == 3 and evaluated["checkpoint"].endswith("step-00000003")
    last = result.validation[-1]
    for key in ("val/reward/mean", "val/test/last_digit/acc/maj@3", "val/response_length/mean"):
        assert evaluated[key] == pytest.approx(last[key]), key
    assert len(read_jsonl(run_dir / "eval_generations.jsonl")) == 2


def test_a_validation_source_that_does_not_exist_fails_at_validate(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridflow",
            "validate",
            "grpo",
            "--set",
            f"validation.source={tmp_path / 'nope.parquet'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "validation.source" in out.stderr and "nope.parquet" in out.stderr

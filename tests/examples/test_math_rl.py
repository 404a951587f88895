"""examples/math_rl.py as users run it: dataset, tokenizer, SFT, GRPO with validation on
the held-out split, the table, plot and summary, and the exit status from the rise."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "math_rl.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_math_rl", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(600)
def test_math_rl_runs_every_phase_and_reports(tmp_path, capsys):
    argv = ["--quick", "--out", str(tmp_path), "--n-train", "200", "--n-test", "16"]
    argv += ["--sft-steps", "3", "--rl-steps", "2", "--val-interval", "1"]
    summary = load().main(argv)
    assert [r["step"] for r in summary["validation"]] == [0, 1, 2]
    assert summary["sft_acc"] == summary["validation"][0]["acc"]
    assert summary["rl_acc"] == summary["validation"][-1]["acc"]
    assert len(summary["sft_loss"]) == 3 and len(summary["train_reward"]) == 2
    assert summary["ok"] == (summary["rise_points"] >= 10)
    assert (tmp_path / "data" / "train.parquet").is_file()
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text())["settings"]["rl_steps"] == 2
    out = capsys.readouterr().out
    assert "held-out acc" in out and "held-out accuracy: SFT" in out
    # Validation generated on the held-out prompts (decoded without the chat markers).
    gens = (tmp_path / "run" / "val_generations.jsonl").read_text().splitlines()
    first = json.loads(gens[0])
    assert first["data_source"] == "hybridflow/word_problems"
    assert "Let's think step by step" in first["prompt"] and "ground_truth" in first


@pytest.mark.timeout(600)
def test_math_rl_lora_trains_adapters_on_the_sft_model(tmp_path):
    """--lora-rank: SFT in full, then GRPO on adapters over the SFT policy (another job)."""
    argv = ["--quick", "--out", str(tmp_path), "--n-train", "200", "--n-test", "16"]
    argv += ["--sft-steps", "3", "--rl-steps", "1", "--val-interval", "1", "--lora-rank", "4"]
    summary = load().main(argv)
    assert [r["step"] for r in summary["validation"]] == [0, 1]
    (ckpt,) = (tmp_path / "run_lora" / "checkpoints").glob("step-*")
    adapter = json.loads((ckpt / "policy" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8
    assert not (ckpt / "policy" / "config.json").exists()  # adapters only, not the model
    assert json.loads((tmp_path / "summary.json").read_text())["settings"]["lora_rank"] == 4


@pytest.mark.example
@pytest.mark.timeout(3600)
def test_math_rl_quick_raises_held_out_accuracy_by_10_points(tmp_path):
    summary = load().main(["--quick", "--out", str(tmp_path)])
    assert 0.05 < summary["sft_acc"] < 0.9, summary["validation"]  # SFT leaves room
    assert summary["rise_points"] >= 10, summary["validation"]
    assert summary["ok"]

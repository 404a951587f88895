"""The examples run as users run them (their `main`, real stage processes, tiny models
on CPU) and print what their docstrings promise."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType

from hybridflow.config.schema import load_topology
from hybridflow.pipeline.plan.planner import build_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_minimal_ppo_generates_scores_and_trains(tmp_path, capsys):
    outputs = load("minimal_ppo").main(["--steps", "6", "--log-dir", str(tmp_path)])
    assert len(outputs["rewards"]) == 6 and len(outputs["loss"]) == 6
    assert all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in outputs["rewards"])
    out = capsys.readouterr().out
    generations = [line for line in out.splitlines() if line.startswith("'last:")]
    assert len(generations) == 4 and all("reward" in g for g in generations)
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    # 6 train steps, then `engine.run` (the logic updates the actor) is step 6.
    assert [json.loads(r)["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    assert "run step: actor/pg_loss" in out


def test_full_ppo_places_roles_and_reports_kl_and_value_loss(tmp_path, capsys):
    yaml_path = tmp_path / "full_ppo.yaml"
    outputs = load("full_ppo").main(
        ["--steps", "3", "--log-dir", str(tmp_path / "run"), "--yaml", str(yaml_path)]
    )
    out = capsys.readouterr().out
    assert "stage engine   device cpu   roles actor, rollout, reference" in out
    assert "roles critic" in out and "roles reward" in out
    assert len(outputs["kl_div"]) == 3 and all(math.isfinite(k) for k in outputs["kl_div"])
    assert outputs["kl_div"][0] == 0.0 and outputs["kl_div"][-1] > 0  # policy leaves the ref
    assert out.count("critic/vf_loss") == 3
    plan = build_plan(load_topology(yaml_path))  # the written topology is a runnable plan
    labels = [op.label for op in plan.ops]
    assert labels[:4] == [
        "rollout.generate",
        "reward.score",
        "reference.get_logprob",
        "critic.values",
    ]
    assert "critic.update" in labels and labels[-1] == "actor.reshard"


def test_sft_then_rl_improves(tmp_path, capsys):
    outputs = load("sft_rlhf_pipeline").main(["--log-dir", str(tmp_path)])
    sft = outputs["sft_loss"]
    assert len(sft) == 4 and sft[-1] < sft[0]  # supervised loss falls
    rewards = outputs["rewards"]
    assert len(rewards) == 8
    k = 2
    assert sum(rewards[-k:]) / k > sum(rewards[:k]) / k  # RL improves on the SFT policy
    out = capsys.readouterr().out
    assert "phase 1: SFT" in out and "phase 2: GRPO" in out and "reward: first 2" in out
    assert (tmp_path / "sft" / "metrics.jsonl").is_file() and (tmp_path / "metrics.jsonl").is_file()

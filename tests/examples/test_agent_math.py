"""examples/agent_math.py: its SFT demonstrations are exactly what the multi-turn rollout
lays out for the same turns, every phase runs and reports (tiny sizes), and --quick
raises held-out accuracy and the tool-use rate (marked `example`)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hybridflow.data import word_problems as wp
from hybridflow.models.loader import load_tokenizer
from hybridflow.stages.rollout.multiturn import TrajectoryLoop, TurnOutput
from hybridflow.stages.rollout.turns import MultiTurnConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_math.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_agent_math", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_tool_turns_put_each_chosen_step_in_a_call():
    am = load()
    solution = "Ann has 7*4=28 apples.\nShe sells 3: 28-3=25.\n#### 25"
    assert am.tool_turns(solution, [False, False]) == [solution]
    call = am.tool_call("28-3")
    assert call == '<tool_call>{"name":"calc","arguments":{"expression":"28-3"}}</tool_call>'
    assert am.tool_turns(solution, [False, True]) == [
        f"Ann has 7*4=28 apples.\nShe sells 3: {call}",
        "#### 25",
    ]
    assert am.tool_turns(solution, [True, True]) == [
        f"Ann has {am.tool_call('7*4')}",
        f"She sells 3: {call}",
        "#### 25",
    ]


class _Replay:
    """A TurnEngine that answers row i's turn k with the demonstration's k-th model span."""

    def __init__(self, turns: list[list[list[int]]]) -> None:
        self.turns = turns

    async def generate(self, requests, turn):
        return [
            TurnOutput(self.turns[r.key][turn], [0.0] * len(self.turns[r.key][turn]), True)
            for r in requests
        ]


def _spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    spans: list[list[int]] = []
    for i, (t, m) in enumerate(zip(ids, mask, strict=True)):
        if m and (i == 0 or not mask[i - 1]):
            spans.append([])
        if m:
            spans[-1].append(t)
    return spans


def test_sft_demonstrations_are_the_rollout_layout_of_their_turns(tmp_path):
    """Replaying a demonstration's model turns through the real trajectory loop (env:
    calculator, the example's template) gives its ids and mask token for token, and the
    environment's reward 1."""
    am, math_rl = load(), sys.modules["math_rl"]
    s = am.QUICK
    train, _ = wp.write_dataset(tmp_path / "data", 60, 4, difficulty=s.difficulty)
    from hybridflow.data.sources import load_records
    from hybridflow.models.tokenizer import TOOL_CHAT_TEMPLATE

    records = load_records(str(train))
    tok_dir = math_rl.make_tokenizer(
        train, s, tmp_path / "tok", chat_template=TOOL_CHAT_TEMPLATE, extra=[am.tool_call("1+2")]
    )
    pairs = am.sft_pairs(records, tok_dir, am.dataclasses.replace(s, tool_share=0.5), 0)
    assert any(0 in p["response_mask"] for p in pairs) and any(
        0 not in p["response_mask"] for p in pairs
    )
    tok = load_tokenizer(str(tok_dir))
    cfg = MultiTurnConfig("calculator", {"max_turns": s.max_turns}, s.max_turns, 0, 10.0, 8, "")
    loop = TrajectoryLoop(cfg, tok, [tok.eos_token_id])
    prompts = [
        tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in records
    ]
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    engine = _Replay([_spans(p["response"], p["response_mask"]) for p in pairs])
    res = asyncio.run(loop.run(engine, prompt_ids, records, s.max_new_tokens))
    for pair, lay in zip(pairs, res.layouts, strict=True):
        assert lay.response_ids == pair["response"]
        assert lay.response_mask == pair["response_mask"]
    assert res.env_reward == [1.0] * len(records)


@pytest.mark.timeout(600)
def test_agent_math_runs_every_phase_and_reports(tmp_path, capsys):
    argv = ["--quick", "--out", str(tmp_path), "--n-train", "200", "--n-test", "16"]
    argv += ["--sft-steps", "3", "--rl-steps", "2", "--val-interval", "1"]
    summary = load().main(argv)
    assert summary["tool"] is True
    assert [r["step"] for r in summary["validation"]] == [0, 1, 2]
    for row in summary["validation"]:
        assert 0 <= row["acc"] <= 1 and 0 <= row["tool_use"] <= 1 and row["turns"] >= 1
    assert summary["sft_acc"] == summary["validation"][0]["acc"]
    assert summary["rl_tool_use"] == summary["validation"][-1]["tool_use"]
    assert len(summary["train_tool_calls"]) == 2
    assert all(x is not None and x >= 0 for x in summary["train_tool_calls"])
    assert summary["ok"] == (summary["rise_points"] >= 10 and summary["tool_rise_points"] >= 20)
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text())["settings"]["tool_share"] > 0
    out = capsys.readouterr().out
    assert "tool use" in out and "held-out accuracy: SFT" in out and "call the tool" in out


@pytest.mark.example
@pytest.mark.learning  # `make test-learning`: make test keeps math_rl's learning run only
@pytest.mark.timeout(3600)
def test_agent_math_quick_raises_accuracy_and_tool_use(tmp_path):
    summary = load().main(["--quick", "--out", str(tmp_path)])
    assert summary["rise_points"] >= 10, summary["validation"]
    assert summary["tool_rise_points"] >= 20, summary["validation"]
    assert summary["ok"]

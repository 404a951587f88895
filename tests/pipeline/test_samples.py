"""Per-step samples (pipeline/observe/samples.py): which rows a step keeps, what the
scheduler keeps of values the dataflow does not declare, how a row reads as a record
(single-turn and multi-turn with tool calls), the sink's file across a resume, where the
sink is installed, and the setting's check. A real multi-turn run writes the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridflow.config.schema import load_topology
from hybridflow.data.batching import encode_metadata
from hybridflow.errors import ConfigError
from hybridflow.pipeline.observe.metrics import JsonlSink, MemorySink, make_sinks
from hybridflow.pipeline.observe.samples import (
    SAMPLES_FILE,
    SamplesSink,
    pick_rows,
    sample_record,
    samples_wanted,
)
from hybridflow.pipeline.plan.planner import build_plan
from hybridflow.pipeline.runtime.scheduler import DRIVER_REPLICA, Scheduler
from hybridflow.stages.env.parsers import get_parser


class CharTokenizer:
    """id = code point: decoding is exact and readable; ids >= 1000 are 'special'."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i >= 1000))

    @staticmethod
    def ids(text: str) -> list[int]:
        return [ord(c) for c in text]


def test_pick_rows_spreads_over_the_step_and_caps_at_its_rows():
    assert pick_rows(4, 2, 4) == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert pick_rows(8, 4, 4) == [(0, 0), (1, 0), (2, 0), (3, 0)]  # one per micro-batch
    assert pick_rows(2, 1, 5) == [(0, 0), (0, 1)]
    assert pick_rows(4, 2, 0) == []


def row(prompt: str, response_runs: list[tuple[str, int]], **extra: torch.Tensor) -> dict:
    tok = CharTokenizer
    p = [1000, 1000, *tok.ids(prompt)]  # left padding (masked out)
    r = [i for text, _ in response_runs for i in tok.ids(text)]
    m = [flag for text, flag in response_runs for _ in text]
    return {
        "prompt_ids": torch.tensor([p]),
        "prompt_mask": torch.tensor([[0, 0] + [1] * len(prompt)]),
        "response_ids": torch.tensor([[*r, 0, 0]]),  # right padding
        "response_mask": torch.tensor([[*m, 0, 0]]),
        **extra,
    }


def test_a_single_turn_record_has_text_reward_and_the_scorers_fields():
    r = row(
        "last:123=",
        [("3", 1)],
        rewards=torch.tensor([0.3], dtype=torch.float32),
        advantages=torch.tensor([[1.5, 0.0, 0.0]]),
        sample_idx=torch.tensor([17]),
        group_index=torch.tensor([4]),
        metadata_json=encode_metadata([{"data_source": "math", "answer": "3"}]),
        reward_info=encode_metadata([{"acc": 1.0, "pred": "3"}]),
    )
    rec = sample_record(5, r, CharTokenizer())
    assert rec == {
        "step": 5,
        "split": "train",
        "sample": 17,
        "prompt_index": 4,
        "data_source": "math",
        "prompt": "last:123=",
        "response": "3",
        "response_length": 1,
        "reward": 0.3,  # float32's shortest repr, not 0.30000001192092896
        "advantage": 1.5,
        "ground_truth": "3",
        "acc": 1.0,
        "pred": "3",
    }
    no_tok = sample_record(5, r, None, split="val")
    assert no_tok["split"] == "val" and no_tok["prompt_ids"] == CharTokenizer.ids("last:123=")
    assert "prompt" not in no_tok and no_tok["response_ids"] == [ord("3")]


def test_a_multi_turn_record_has_each_turn_its_tool_calls_and_observations():
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "3*4"}}\n</tool_call>'
    r = row(
        "What is 3*4?",
        [(f"Let me compute. {call}", 1), ("\n[calc] 12\n", 0), ("12", 1)],
        num_turns=torch.tensor([2]),
        env_reward=torch.tensor([1.0]),
        rewards=torch.tensor([1.0]),
    )
    rec = sample_record(0, r, CharTokenizer(), parser=get_parser("hermes", "tool_parser"))
    assert rec["num_turns"] == 2 and rec["env_reward"] == 1.0
    first, second = rec["turns"]
    assert first["response"] == f"Let me compute. {call}"
    assert first["tool_calls"] == [{"name": "calc", "arguments": {"expression": "3*4"}}]
    assert first["observation"] == "\n[calc] 12\n"
    assert second == {"response": "12"}  # no call, no observation after the last turn
    assert rec["response"] == f"Let me compute. {call}12"  # the model's tokens alone
    assert rec["response_length"] == len(f"Let me compute. {call}12")
    # A malformed call is shown as the parser's error, not dropped.
    bad = row("q", [("<tool_call>{oops}</tool_call>", 1)], num_turns=torch.tensor([1]))
    turn = sample_record(0, bad, CharTokenizer(), parser=get_parser("hermes", "t"))["turns"][0]
    assert list(turn["tool_calls"][0]) == ["error"]


def test_the_sink_writes_lines_and_a_resumed_run_keeps_the_earlier_steps(tmp_path):
    r = row("p", [("a", 1)], rewards=torch.tensor([1.0]))
    sink = SamplesSink(tmp_path, 2)
    sink.write_samples(0, [r, r, r], CharTokenizer())  # at most samples_per_step
    sink.write_samples(1, [r], CharTokenizer(), split="val")
    sink.close()
    lines = [json.loads(x) for x in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [(x["step"], x["split"]) for x in lines] == [(0, "train"), (0, "train"), (1, "val")]
    with (tmp_path / SAMPLES_FILE).open("a") as f:
        f.write('{"step": 1, "spl')  # a crash mid-line
    resumed = SamplesSink(tmp_path, 2, start_step=1)
    resumed.close()
    kept = [json.loads(x) for x in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [x["step"] for x in kept] == [0, 0]


def built(names: list[str], run_dir: Path, *overrides: str) -> list[type]:
    """The classes of the sinks `make_sinks` builds (closed again)."""
    topo = load_topology("grpo", [f"run_dir={run_dir}", *overrides])
    sinks = make_sinks(names, run_dir, topo)
    try:
        assert samples_wanted(sinks) == (4 if SamplesSink in map(type, sinks) else 0)
        return [type(s) for s in sinks]
    finally:
        for s in sinks:
            s.close()


def test_the_sink_rides_beside_jsonl_only_and_zero_turns_it_off(tmp_path):
    assert built(["jsonl"], tmp_path) == [JsonlSink, SamplesSink]  # 4: the default
    assert built(["memory"], tmp_path) == [MemorySink]
    assert built(["jsonl"], tmp_path, "metrics.samples_per_step=0") == [JsonlSink]


def test_a_negative_samples_per_step_names_its_key():
    with pytest.raises(ConfigError, match=r"metrics\.samples_per_step: must be >= 0, got -1"):
        load_topology("grpo", ["metrics.samples_per_step=-1"])


def test_the_scheduler_keeps_undeclared_values_for_the_picked_rows_only():
    """The score op returns reward_info beside its declared rewards (as the function
    backend does): the picked rows' reward_info reaches the samples, nothing else does."""
    topo = load_topology(
        {
            "name": "samples",
            "run": {"steps": 2, "step_batch": 8, "micro_batch": 4},
            "data": {"fields": ["sample_idx", "prompt_ids"]},
            "stages": {
                "s": {
                    "roles": {
                        "rollout": {"backend": "synthetic"},
                        "reward": {"backend": "synthetic"},
                    }
                }
            },
            "dataflow": [
                {
                    "role": "rollout",
                    "op": "generate",
                    "inputs": ["sample_idx", "prompt_ids"],
                    "outputs": ["response_ids"],
                },
                {
                    "role": "reward",
                    "op": "score",
                    "inputs": ["sample_idx", "response_ids"],
                    "outputs": ["rewards"],
                },
            ],
            "metrics": {"backends": ["memory"]},
        }
    )
    sched = Scheduler(build_plan(topo))
    sched.sample_rows = 3
    for step in sched.data_requests():
        idx = torch.arange(step * 8, step * 8 + 8)
        sched.add_data(step, {"sample_idx": idx, "prompt_ids": idx[:, None].repeat(1, 2)})
    while not sched.done:
        for d in sched.ready():
            idx = d.inputs["sample_idx"]
            if d.op.cfg.op == "generate":
                out = {"response_ids": idx[:, None] + 100, "num_turns_typo": idx}
            else:
                info = encode_metadata([{"pred": str(int(i))} for i in idx])
                out = {"rewards": idx.float(), "reward_info": info, "advantages": idx[:, None]}
            sched.complete(d.task_id, 0 if d.replicas else DRIVER_REPLICA, out, {})
    samples = sched.pop_samples()
    assert [s for s, _ in samples] == [0, 1]
    rows = samples[1][1]
    assert [int(r["sample_idx"]) for r in rows] == [8, 10, 13]  # spread: rows 0, 2, 5
    for r in rows:
        assert set(r) == {
            "sample_idx",
            "prompt_ids",
            "response_ids",
            "rewards",
            "reward_info",
            "advantages",
        }
        rec = sample_record(1, r)
        assert rec["pred"] == str(rec["sample"]) and rec["reward"] == rec["sample"]
    assert not sched.pop_samples()  # handed out once


@pytest.mark.slow
def test_a_multi_turn_run_writes_its_turns_and_its_validation_samples(tmp_path, monkeypatch):
    """The guess-the-number game over real stage processes (tests/rollout_multiturn's
    topology), validated on the same games: samples.jsonl holds every step's training
    samples with each turn and observation, and the validations' with split "val"."""
    import sys

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).parents[1] / "rollout_multiturn"))
    from test_mt_e2e import config

    from hybridflow.pipeline.runtime.runner import run_topology

    cfg = config(tmp_path, "run")
    cfg["metrics"] = {"backends": ["jsonl"], "samples_per_step": 2}
    cfg["validation"] = {"source": str(tmp_path / "games.jsonl"), "max_prompts": 2}
    run_topology(load_topology(cfg))
    lines = [json.loads(x) for x in (tmp_path / "run" / SAMPLES_FILE).read_text().splitlines()]
    train = [x for x in lines if x["split"] == "train"]
    val = [x for x in lines if x["split"] == "val"]
    assert [x["step"] for x in train] == [0, 0, 1, 1]
    assert [x["step"] for x in val] == [0, 0, 2, 2]  # before training, after the last step
    for x in lines:
        assert x["data_source"] == "hybridflow/guess_number" and "guesses" in x["prompt"]
        assert x["num_turns"] == len(x["turns"]) >= 1
        for turn in x["turns"][:-1]:  # every turn but the last got the game's answer
            assert "guess" in turn["observation"] or "integer" in turn["observation"]
        assert "reward" in x and "env_reward" in x

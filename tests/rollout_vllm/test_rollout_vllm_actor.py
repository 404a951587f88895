"""The vLLM engine fed by a real actor, as the runtime feeds it.

(1) In process (the hybrid engine): `actor.reshard` hands over `named_parameters()`, where
    a tied LM head appears once (as the embedding); the engine must still generate what HF
    generates with the actor's weights (vLLM refreshes its head only when `lm_head.weight`
    arrives: vllm_compat feeds it).
(2) A short GRPO run (the `grpo` preset, made smaller) with the vllm backend learns, the
    same whether the engine is colocated with the actor or in its own stage process fed
    over the transport (pipeline/host/weight_sync.py), and like the hf backend on the same run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from _policy import EOS, PAD, PRESET, RUN_SEED, left_pad, responses
from vllm_helpers import MAX_NEW

from hybridflow.config.loader import to_dict
from hybridflow.config.schema import load_topology
from hybridflow.pipeline.runtime.runner import run_topology
from hybridflow.stages.actor import Actor
from hybridflow.stages.base import StageContext
from hybridflow.stages.rollout import vllm_compat

pytestmark = pytest.mark.skipif(
    not vllm_compat.vllm_available(), reason="vLLM not installed (use .venv-vllm)"
)


def _hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
        max_new_tokens=MAX_NEW,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )[0, len(prompt) :].tolist()
    return out[: out.index(EOS) + 1] if EOS in out else out


def test_actor_reshard_of_tied_weights_reaches_the_engine(rollout, tmp_path):
    actor = Actor()
    actor.setup(
        StageContext(
            stage="engine",
            replica=0,
            device=torch.device("cpu"),
            seed=RUN_SEED,
            run_dir=tmp_path,
            options={"model": PRESET},
            colocated={"rollout": rollout},
            log=logging.getLogger("test.vllm"),
        )
    )
    assert actor.model.config.tie_word_embeddings
    assert "lm_head.weight" not in dict(actor.named_weights())  # tied: listed once
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # "a training step": every weight moves, the embedding included
        for p in actor.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    _, metrics = actor.handle("reshard", {}, {"version": 7})
    assert metrics["reshard/tensors"] >= len(dict(actor.named_weights()))
    prompts = [[5, 6, 7, 8], [30, 31, 32, 33, 34, 35], [12, 13]]
    ids, mask = left_pad(prompts)
    out, m = rollout.handle(
        "generate", {"prompt_ids": ids, "prompt_mask": mask}, {"temperature": 0.0}
    )
    assert m["rollout/policy_version"] == 7.0
    assert responses(out) == [_hf_greedy(actor.model, p) for p in prompts]


# ---------------------------------------------------------------------------------------

STEPS = 12


def _grpo(tmp_path: Path, backend: str, disaggregated: bool) -> dict[str, Any]:
    """The `grpo` preset (rollout + actor in one engine process; the task's rule reward),
    made small enough for CPU: the vLLM-capable tiny model everywhere, 4 prompts x 8
    samples a step, no reference model (kl_loss_coef 0), reward in the engine process.
    `disaggregated`: the rollout moves to its own stage and gets the weights through
    `rollout.load_weights` (no inputs: streamed by actor.reshard)."""
    d = to_dict(load_topology("grpo"))
    d["run"].update(steps=STEPS, step_batch=32, micro_batch=32)
    d["metrics"]["backends"] = ["memory"]
    d["run_dir"] = str(tmp_path / f"{backend}-{disaggregated}")
    engine = d["stages"]["engine"]["roles"]
    engine.pop("reference")
    engine["reward"] = d["stages"].pop("reward")["roles"]["reward"]
    engine["rollout"]["backend"] = backend
    engine["rollout"]["options"]["model"] = PRESET
    engine["actor"]["options"].update(model=PRESET, kl_loss_coef=0.0, lr=1e-2)
    if backend == "vllm":
        engine["rollout"]["options"].update(max_model_len=64, kv_cache_bytes=16 << 20)
    d["dataflow"] = [op for op in d["dataflow"] if op["role"] != "reference"]
    for op in d["dataflow"]:
        op["inputs"] = [name for name in op.get("inputs", []) if name != "ref_logprobs"]
    if disaggregated:
        d["stages"]["gen"] = {"roles": {"rollout": engine.pop("rollout")}}
        d["dataflow"].append(
            {"role": "rollout", "op": "load_weights", "scope": "step", "phase": "reshard"}
        )
    return d


def _rewards(tmp_path: Path, backend: str, disaggregated: bool) -> list[float]:
    result = run_topology(load_topology(_grpo(tmp_path, backend, disaggregated)))
    if disaggregated:
        assert all(m["weight_sync/buckets"] >= 1 for m in result.metrics)
    assert [m["rollout/policy_version"] for m in result.metrics[1:]] == list(range(1, STEPS))
    return [m["reward/mean"] for m in result.metrics]


def _rise(rewards: list[float]) -> float:
    return sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3


def test_grpo_with_vllm_learns_colocated_and_disaggregated_like_hf(tmp_path):
    colocated = _rewards(tmp_path, "vllm", False)
    disaggregated = _rewards(tmp_path, "vllm", True)
    hf = _rewards(tmp_path, "hf", False)
    # Same seeds, same weights after every exact reshard: the same run either way.
    assert disaggregated == colocated
    # From random init the reward starts near 0; both backends learn the answer format.
    # (Seen here: vllm 0.00 -> ~0.34, hf 0.01 -> ~0.33 over the last 3 steps.)
    assert _rise(colocated) > 0.15, colocated
    assert _rise(hf) > 0.15, hf
    assert abs(_rise(colocated) - _rise(hf)) < 0.2, (colocated, hf)


def test_bench_rollout_measures_both_backends(capsys):
    from hybridflow.cli import main

    argv = ["bench", "rollout", "--json", "--quick", "--set", "prompts=2"]
    assert main([*argv, "--set", "max_new_tokens=5", "--set", "reps=1"]) == 0
    out = json.loads(capsys.readouterr().out)  # vLLM's own logging stays off stdout
    for backend in ("hf", "native", "vllm"):
        assert out[backend]["tokens_per_call"] == 2 * 5  # same work: EOS does not stop
        assert out[backend]["tokens_per_s"] > 0
    assert out["vllm_over_hf"] > 0

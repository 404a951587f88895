"""`hybridflow bench reshard` and `hybridflow bench rollout` through the CLI, at their
smallest sizes: the JSON has every figure, and the figures add up."""

from __future__ import annotations

import json

import pytest

from hybridflow.cli import main
from hybridflow.stages.rollout.vllm_compat import vllm_available


def _bench(capsys, *argv: str) -> dict:
    assert main(["bench", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_reshard_quick(capsys):
    out = _bench(capsys, "reshard", "--quick")
    tiny, shapes = out["sizes"]  # quick runs both modes of the full bench, at small sizes
    assert tiny["preset"] == "tiny" and tiny["mode"] == "roles" and shapes["mode"] == "shapes"
    assert tiny["bytes"] == 4 * tiny["params"] == tiny["bytes_moved"]  # fp32, one receiver
    for key in ("copy", "colocated", "disaggregated"):
        assert tiny[f"{key}_s"] > 0 and tiny[f"{key}_gbps"] > 0
    assert tiny["disaggregated_first_s"] > 0 and tiny["disaggregated_step_s"] > 0


@pytest.mark.skipif(vllm_available(), reason="checks the report without vLLM")
def test_bench_rollout_reports_hf_and_says_vllm_is_missing(capsys):
    out = _bench(
        capsys, "rollout", "--quick", "--set", "prompts=2", "--set", "max_new_tokens=5",
        "--set", "reps=1",
    )  # fmt: skip
    assert out["vllm"] == "not installed"
    assert out["hf"]["tokens_per_call"] == 2 * 5  # EOS does not stop: equal work per backend
    assert out["hf"]["tokens_per_s"] > 0 and out["model"] == "tiny-vllm"
    assert out["native"]["tokens_per_call"] == 2 * 5 and out["native_over_hf"] > 0
    assert set(out["native"]["tokens_per_s_by_concurrency"]) == {"1", "2", "4", "8"}

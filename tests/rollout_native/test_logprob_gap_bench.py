"""The log-prob gap benchmark (hybridflow/bench/logprob_gap.py) on CPU, quick preset."""

from __future__ import annotations

import argparse
import json

from hybridflow.bench.logprob_gap import run


def test_quick_run_reports_a_tiny_fp32_gap() -> None:
    out = run(argparse.Namespace(quick=True))
    json.dumps(out)  # serialisable
    assert {"bench", "model", "tokens", "settings"} <= set(out)
    assert out["bench"] == "logprob_gap" and out["model"] == "tiny" and out["tokens"] > 0
    settings = out["settings"]
    bf16 = {"bf16_engine_autocast_actor", "bf16_engine_bf16_actor"}
    assert set(settings) == {"fp32", *bf16, *(f"{n}_fp32_head" for n in bf16)}
    fp32 = settings["fp32"]
    assert {"max_abs", "mean_abs"} <= set(fp32)
    assert fp32["max_abs"] < 1e-4 and fp32["mean_abs"] <= fp32["max_abs"]
    for name, s in settings.items():
        assert "skipped" in s or {"max_abs", "mean_abs"} <= set(s), name

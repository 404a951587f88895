"""bench/fsdp_lora_memory.py on `tiny` (issue 24): its per-rank accounting adds up. Two
gloo ranks each hold half of what one holds (shards, gradients, AdamW moments); under
LoRA only the adapters have gradients and moments; the bench runs as a script (its ranks
are spawned from its own module)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench" / "fsdp_lora_memory.py"
FIELDS = ("params_bytes", "trainable_bytes", "grad_bytes", "optimizer_bytes")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")
def test_the_fsdp_lora_memory_bench_counts_each_ranks_shards():
    cmd = [sys.executable, str(BENCH), "--presets", "tiny", "--ranks", "0", "8"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=110, check=True).stdout
    rows = {(r["lora_rank"], r["world"]): r for r in map(json.loads, out.splitlines())}
    assert sorted(rows) == [(0, 1), (0, 2), (8, 1), (8, 2)]
    for (lora_rank, world), row in rows.items():
        assert len(row["ranks"]) == world
        one = rows[(lora_rank, 1)]["ranks"][0]
        for k in FIELDS:  # the shards of two ranks make up what one rank holds
            assert row["total"][k] == one[k], (lora_rank, world, k)
            assert all(r[k] <= one[k] // world + 1024 for r in row["ranks"]), k
        for r in row["ranks"]:
            assert r["grad_bytes"] == r["trainable_bytes"] > 0
            assert r["optimizer_bytes"] == 2 * r["trainable_bytes"]  # exp_avg + exp_avg_sq
    full, lora = rows[(0, 1)], rows[(8, 1)]
    assert full["trained_params"] == full["params"]
    assert full["ranks"][0]["trainable_bytes"] == 4 * full["params"]  # fp32
    assert lora["params"] > full["params"] > 5 * lora["trained_params"]
    assert lora["ranks"][0]["trainable_bytes"] == 4 * lora["trained_params"]

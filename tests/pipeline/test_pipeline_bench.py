"""`hybridflow bench overlap` runs end to end and reports what it promises (structure and
consistency only: timing numbers belong to the benchmark, not to assertions)."""

from __future__ import annotations

import argparse
import threading

import pytest

from hybridflow.bench import overlap


def test_bench_overlap_quick_reports_every_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small = [
        "run.step_batch=16",
        "run.micro_batch=2",
        *(f"stages.{s}.roles.{s}.options.ms_per_sample=1" for s in ("rollout", "reward", "actor")),
    ]
    args = argparse.Namespace(config=None, overrides=small, quick=True, json=True, out=None)
    res = overlap.run(args)
    assert res["micro_batches"] == 8 and res["steps"] == 1
    for key in (
        "sequential_s",
        "streamed_s",
        "ideal_s",
        "speedup",
        "efficiency",
        "overhead_us_per_event",
    ):
        assert isinstance(res[key], float) and res[key] > 0, key
    assert res["speedup"] == pytest.approx(res["sequential_s"] / res["streamed_s"], rel=0.01)
    assert res["efficiency"] == pytest.approx(res["ideal_s"] / res["streamed_s"], rel=0.01)
    assert res["zero_cost_tasks"] == 3 * (3 * 8 + 3)  # 3 steps x (3 mb ops x 8 + 3 step ops)


def test_bench_step_quick_reports_phases_and_throughput(tmp_path, monkeypatch):
    """`bench step --quick`: the CPU grpo preset with the native rollout, 3 steps; the
    fields are consistent with each other (no timing thresholds)."""
    from hybridflow.bench import step

    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(
        config=None, overrides=[f"run_dir={tmp_path}"], quick=True, json=True, out=None
    )
    res = step.run(args)
    assert res["config"] == "grpo" and res["steps_timed"] == 2 and res["step_batch"] == 32
    assert res["samples_per_s"] == pytest.approx(32 / res["period_s"], rel=0.01)
    assert {"rollout", "reward", "ref", "adv", "train", "reshard"} <= set(res["phases"])
    assert res["gen_tokens_per_s"] > 0 and 0 < res["response_len_mean"] <= 8
    assert -1.0 < res["overlap_share"] < 1.0
    assert res["peak_gpu_mem_gb"] is None  # CPU
    # a CPU-only topology names no GPU, so even a machine with nvidia-smi reports none
    assert res["gpu_mem_per_device"] in (None, {})


def test_bench_transport_quick_runs_every_cpu_tier(monkeypatch):
    """`bench transport --quick` end to end on CPU: both processes agree on the run (its
    shared-memory names carry the run's prefix, which receivers check)."""
    from hybridflow.bench import transport

    args = argparse.Namespace(
        config=None,
        overrides=["rtt_iters=50", "reps=2", "sizes_mib=1", "gpu_sizes_mib=1"],
        quick=True,
        json=True,
        out=None,
    )
    res = transport.run(args)
    tiers = {c["tier"] for c in res["cases"]}
    assert {"rtt", "frame", "shm", "shm_oneshot"} <= tiers
    assert all(c["gb_per_s"] >= 0 for c in res["cases"])


def test_bench_train_runs_two_gloo_ranks_and_reports_throughput():
    from hybridflow.bench import train

    args = argparse.Namespace(ranks="1,2", quick=True, json=True, reduce_dtypes="float32")
    res = train.run(args)
    one, two = res["results"]
    assert (one["ranks"], two["ranks"]) == (1, 2)
    assert one["params"] == two["params"] > 0  # the group counts every shard once
    assert one["grad_bytes_per_step"] == 0 and two["grad_bytes_per_step"] == one["params"] * 2
    for r in (one, two):
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0 and r["mfu"] is None  # CPU
    # The same data on one rank and on two: the same weights, to rounding.
    assert two["final_param_checksum"] == pytest.approx(one["final_param_checksum"], rel=1e-6)


def test_gpu_memory_sampler_keeps_each_devices_peak_under_run_names(monkeypatch):
    """The sampler's seam is nvidia-smi's CSV: physical indices map to the run's cuda:<i>
    through CUDA_VISIBLE_DEVICES, hidden devices and unreadable rows drop out, and each
    device keeps its peak and its figure from before the run."""
    from hybridflow.bench import gpumem

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    readings = ["2, 1024\n3, 512\n", "2, 8192\n3, [N/A]\n0, 90000\n", "2, 4096\n3, 2048\n"]
    calls = threading.Semaphore(0)

    def query() -> str:
        calls.release()
        return readings.pop(0) if len(readings) > 1 else readings[0]

    with gpumem.DeviceMemorySampler(interval_s=0.01, query=query) as mem:
        for _ in range(4):  # the reading before the run, then three polls
            assert calls.acquire(timeout=10)
    assert mem.report() == {
        "cuda:0": {"peak_used_gb": 8.0, "before_gb": 1.0},
        "cuda:1": {"peak_used_gb": 2.0, "before_gb": 0.5},
    }
    assert gpumem.visible_devices("GPU-0a1b,GPU-2c3d") is None  # UUIDs: no mapping


def test_gpu_memory_report_is_none_without_nvidia_smi(monkeypatch):
    from hybridflow.bench import gpumem

    monkeypatch.setattr(gpumem.shutil, "which", lambda _: None)
    with gpumem.DeviceMemorySampler(interval_s=0.01) as mem:
        pass
    assert mem.report() is None

"""Every `hybridflow bench` subcommand runs end to end with `--quick` through the CLI, and
reports what it promises (structure and consistency only: timing numbers belong to the
benchmark, not to assertions).

`--quick` takes the same code paths as the full run at small sizes (a path only the full
run took once shipped broken: `bench reshard` raised while `--quick` passed), so these
smoke tests are what keeps each command working. Paths that need a GPU are reported as
skipped in the bench's JSON on CPU. Torch runs one thread in this process and in the
stage processes the benches start: on a shared 2-core machine a second thread only waits.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow import cli


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def bench(tmp_path: Path, what: str, *sets: str) -> dict[str, Any]:
    """`hybridflow bench WHAT --quick --json --out FILE [--set ...]`, in process."""
    out = tmp_path / f"{what}.json"
    argv = ["bench", what, "--quick", "--json", "--out", str(out)]
    for s in sets:
        argv += ["--set", s]
    assert cli.main(argv) == 0
    return json.loads(out.read_text())


def test_every_bench_subcommand_has_a_smoke_test_here():
    names = {n for n in globals() if n.startswith("test_bench_")}
    missing = [
        b
        for b in cli.BENCHES
        if not any(n.startswith(f"test_bench_{b.replace('-', '_')}_") for n in names)
    ]
    assert not missing, f"bench subcommands without a --quick smoke test: {missing}"


@pytest.mark.slow
def test_bench_overlap_quick_reports_every_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    small = [
        "run.step_batch=16",
        "run.micro_batch=2",
        *(f"stages.{s}.roles.{s}.options.ms_per_sample=1" for s in ("rollout", "reward", "actor")),
    ]
    res = bench(tmp_path, "overlap", *small)
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


@pytest.mark.slow
def test_bench_step_quick_reports_phases_and_throughput(tmp_path, monkeypatch):
    """`bench step --quick`: the CPU grpo preset with the native rollout, 3 steps; the
    fields are consistent with each other (no timing thresholds)."""
    monkeypatch.chdir(tmp_path)
    res = bench(tmp_path, "step", f"run_dir={tmp_path}")
    assert res["config"] == "grpo" and res["steps_timed"] == 2 and res["step_batch"] == 32
    assert res["samples_per_s"] == pytest.approx(32 / res["period_s"], rel=0.01)
    assert {"rollout", "reward", "ref", "adv", "train", "reshard"} <= set(res["phases"])
    assert res["gen_tokens_per_s"] > 0 and 0 < res["response_len_mean"] <= 8
    assert -1.0 < res["overlap_share"] < 1.0
    assert res["peak_gpu_mem_gb"] is None  # CPU
    # a CPU-only topology names no GPU, so even a machine with nvidia-smi reports none
    assert res["gpu_mem_per_device"] in (None, {})


@pytest.mark.slow
def test_bench_transport_quick_runs_every_cpu_tier(tmp_path):
    """`bench transport --quick` end to end on CPU: both processes agree on the run (its
    shared-memory names carry the run's prefix, which receivers check)."""
    res = bench(tmp_path, "transport", "rtt_iters=50", "reps=2", "sizes_mib=1", "gpu_sizes_mib=1")
    tiers = {c["tier"] for c in res["cases"]}
    assert {"rtt", "frame", "shm", "shm_oneshot"} <= tiers
    assert all(c["gb_per_s"] >= 0 for c in res["cases"])
    if not torch.cuda.is_available():
        assert res["skipped"] == ["cuda_ipc: no CUDA device", "nccl: needs two CUDA devices"]


@pytest.mark.slow
def test_bench_train_runs_two_gloo_ranks_and_reports_throughput(tmp_path):
    res = bench(tmp_path, "train")  # --quick: ranks 1 and 2, one step of one micro-batch
    one, two = res["results"]
    assert (one["ranks"], two["ranks"]) == (1, 2)
    assert one["params"] == two["params"] > 0  # the group counts every shard once
    assert one["grad_bytes_per_step"] == 0 and two["grad_bytes_per_step"] == one["params"] * 2
    for r in (one, two):
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0 and r["mfu"] is None  # CPU
    # The same data on one rank and on two: the same weights, to rounding.
    assert two["final_param_checksum"] == pytest.approx(one["final_param_checksum"], rel=1e-6)


@pytest.mark.slow
def test_bench_reshard_quick_runs_both_modes_and_the_receiver_loads_the_weights(tmp_path):
    """Both modes of the full run: real roles (in process, and a two-stage run) and preset
    shapes (a sender here, a receiver process that proves itself with the link's secret)."""
    res = bench(tmp_path, "reshard")
    assert res["quick"] is True
    by_mode = {s["mode"]: s for s in res["sizes"]}
    assert set(by_mode) == {"roles", "shapes"}
    for s in res["sizes"]:
        assert s["bytes_moved"] == s["bytes"] > 0 and s["buckets"] >= 1
        assert s["copy_s"] > 0 and s["disaggregated_s"] > 0 and s["disaggregated_first_s"] > 0
    assert by_mode["roles"]["colocated_s"] > 0 and by_mode["roles"]["disaggregated_step_s"] > 0
    assert by_mode["shapes"]["verified"] is True and by_mode["shapes"]["colocated_s"] is None


@pytest.mark.slow
def test_bench_reward_quick_streams_scoring_behind_rollout(tmp_path):
    res = bench(tmp_path, "reward")
    assert (res["steps"], res["micro_batches"], res["micro_batch"]) == (2, 2, 8)
    requests = res["steps"] * res["micro_batches"] * res["requests_per_micro_batch"]
    assert res["service_requests_streamed"] == requests  # none lost, none repeated
    for key in ("sequential_step_s", "streamed_step_s", "service_requests_per_s_burst"):
        assert res[key] > 0, key
    assert res["speedup"] == pytest.approx(
        res["sequential_step_s"] / res["streamed_step_s"], rel=0.01
    )


@pytest.mark.slow
def test_bench_rollout_quick_measures_hf_and_native_on_the_same_work(tmp_path):
    res = bench(tmp_path, "rollout")
    want = res["prompts"] * res["max_new_tokens"]  # EOS does not stop a bench sample
    for backend in ("hf", "native"):
        assert res[backend]["tokens_per_call"] == want and res[backend]["tokens_per_s"] > 0
    assert set(res["native"]["tokens_per_s_by_concurrency"]) == {"1", "2", "4", "8"}
    assert res["vllm"] == "not installed" or res["vllm"]["tokens_per_call"] == want


@pytest.mark.slow
def test_bench_engine_reuse_quick_runs_later_calls_on_the_same_processes(tmp_path):
    res = bench(tmp_path, "engine-reuse")
    assert res["same_pids"] is True and res["steps"] == 1
    assert res["first_train_s"] > 0 and res["second_train_s"] > 0 and res["run_s"] > 0


@pytest.mark.slow
def test_bench_native_engine_quick_runs_each_size_and_says_what_needs_a_gpu(tmp_path):
    res = bench(tmp_path, "native-engine")
    results = res["results"]
    assert {r["seqs"] for r in results} == {2, 4}
    for r in results:
        assert r["tokens"] == r["seqs"] * res["max_new_tokens"] and r["tokens_per_s"] > 0
    if torch.cuda.is_available():
        modes = {(r["cuda_graphs"], r["frontend"]) for r in results}
        assert modes == {(True, "sync"), (True, "async"), (False, "sync")}
        assert res["skipped"] == []
    else:
        assert {(r["cuda_graphs"], r["frontend"]) for r in results} == {(False, "sync")}
        assert res["skipped"] == [
            "cuda_graphs: no CUDA device",
            "async frontend: measured with CUDA graphs only",
        ]


@pytest.mark.slow
def test_bench_logprob_gap_quick_reports_every_setting(tmp_path):
    res = bench(tmp_path, "logprob-gap")
    settings = res["settings"]
    assert res["tokens"] > 0 and len(settings) == 5
    assert settings["fp32"]["max_abs"] < 1e-3  # one model, one precision: the same log-probs
    for name, s in settings.items():
        assert "skipped" in s or s["tokens"] == res["tokens"], name


def test_bench_settings_are_read_or_refused_never_ignored(tmp_path, capsys):
    """`--set` names an option of a bench with options, and is an error for one without."""
    assert cli.main(["bench", "native-engine", "--set", "seq=4"]) == 2
    assert "bench.native_engine.seq: unknown setting; known:" in capsys.readouterr().err
    assert cli.main(["bench", "train", "--set", "rows=many"]) == 2
    assert "bench.train.rows: expected an integer, got 'many'" in capsys.readouterr().err
    assert cli.main(["bench", "reshard", "--set", "reps=1"]) == 2
    assert "bench.reshard: takes no --set settings" in capsys.readouterr().err


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

"""`hybridflow bench step --json [--config PRESET_OR_FILE] [--set KEY=VALUE] [--quick]`:
end-to-end RL steps on a topology, and where their time goes.

Runs the topology (default: the bundled `grpo-gpu` preset; `--quick`: the CPU `grpo`
preset with the native rollout, 3 small steps) over real stage processes and reads the
per-step metrics. The first step is a warm-up (CUDA-graph capture, allocator growth,
lazy inits) and is reported apart; the figures are medians over the other steps:

  samples_per_s          run.step_batch / timing/period (throughput: with
                         max_offpolicy_steps > 0 steps overlap, and the period between two
                         step finishes is shorter than one step's latency)
  period_s               timing/period
  gen_tokens_per_s       generated tokens of the step / timing/rollout (the rollout
                         phase's wall time: first generate sent -> last result back)
  step_s                 timing/step (one step's latency, start to finish)
  phases                 per phase: wall_s (timing/<phase>: first dispatch -> last result)
                         and compute_s (compute/<phase>: seconds inside the role's op,
                         summed over micro-batches)
  overlap_share          1 - step_s / sum(phase wall_s): the share of phase time hidden
                         by running phases at the same time (0 = strictly one after another)
  peak_gpu_mem_gb        the rollout stage process's peak allocated CUDA memory (the whole
                         hybrid engine when colocated), when it runs on a GPU
  gpu_mem_per_device     per device the run uses: nvidia-smi's memory.used, peak while the
                         run lasted and before it started (every process on the device,
                         CUDA contexts and caches included); null without nvidia-smi
  reward_mean            first and last step's reward/mean (a sanity check, not a goal)
  transport              tensor megabytes the coordinator sent to stages and got back per
                         step, the seconds it spent inside those sends (encoding and
                         copying out; receiving is not timed) and their share of step_s
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from typing import Any

from hybridflow.bench.gpumem import DeviceMemorySampler
from hybridflow.config.schema import Topology, load_topology
from hybridflow.pipeline.runtime.runner import run_topology

QUICK = [
    "run.steps=3",
    "run.step_batch=32",
    "run.micro_batch=8",
    "run.max_inflight=4",
    "stages.engine.roles.rollout.backend=native",
    "stages.engine.roles.rollout.options.max_prompt_len=64",
    "stages.engine.roles.rollout.options.max_new_tokens=8",
]


def run(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    config = getattr(args, "config", None) or ("grpo" if quick else "grpo-gpu")
    overrides = [*(QUICK if quick else []), *(getattr(args, "overrides", None) or [])]
    if not any(o.startswith("metrics.backends") for o in overrides):
        overrides.append("metrics.backends=[memory]")
    topo = load_topology(config, overrides)
    with contextlib.redirect_stdout(sys.stderr), DeviceMemorySampler() as mem:  # stdout: JSON
        result = run_topology(topo)
    summary = summarize(config, topo.run.step_batch, result.metrics, result.startup_s)
    summary["gpu_mem_per_device"] = used_devices(mem.report(), topo)
    return summary


def used_devices(
    report: dict[str, dict[str, float]] | None, topo: Topology
) -> dict[str, dict[str, float]] | None:
    """The sampler's report cut to the devices the topology names (a shared machine's
    other GPUs say nothing about this run)."""
    if report is None:
        return None
    named = {s.device_of(r) for s in topo.stages.values() for r in range(s.replicas)}
    return {dev: v for dev, v in report.items() if dev in named}


def summarize(
    config: str, step_batch: int, rows: list[dict[str, float]], startup_s: float
) -> dict[str, Any]:
    if not rows:
        raise RuntimeError("the run produced no step metrics")
    timed = rows[1:] or rows  # step 0 warms up

    def med(key: str) -> float:
        values = [r[key] for r in timed if key in r]
        return statistics.median(values) if values else 0.0

    phases = sorted(
        {k.split("/", 1)[1] for r in timed for k in r if k.startswith("timing/")}
        - {"step", "period"}
    )
    step_s = med("timing/step")
    period_s = med("timing/period") or step_s
    wall = {p: med(f"timing/{p}") for p in phases}
    gen_tokens = [
        r["response_length/mean"] * step_batch / r["timing/rollout"]
        for r in timed
        if r.get("timing/rollout") and "response_length/mean" in r
    ]
    peak = [r["rollout/peak_mem_gb"] for r in rows if "rollout/peak_mem_gb" in r]
    return {
        "bench": "step",
        "config": config,
        "steps_timed": len(timed),
        "step_batch": step_batch,
        "samples_per_s": round(step_batch / period_s, 3) if period_s else 0.0,
        "period_s": round(period_s, 4),
        "gen_tokens_per_s": round(statistics.median(gen_tokens), 1) if gen_tokens else 0.0,
        "step_s": round(step_s, 4),
        "warmup_step_s": round(rows[0].get("timing/step", 0.0), 4),
        "startup_s": round(startup_s, 3),
        "response_len_mean": round(med("response_length/mean"), 2),
        "phases": {
            p: {"wall_s": round(wall[p], 4), "compute_s": round(med(f"compute/{p}"), 4)}
            for p in phases
        },
        "overlap_share": round(1 - step_s / sum(wall.values()), 3) if sum(wall.values()) else 0.0,
        "peak_gpu_mem_gb": round(max(peak), 2) if peak else None,
        "concurrent_generate_calls": round(med("rollout/concurrent_calls"), 2),
        "transport": {
            "to_stages_mb": round(med("perf/transport_to_stages_mb"), 3),
            "from_stages_mb": round(med("perf/transport_from_stages_mb"), 3),
            "send_s": round(med("perf/transport_send_s"), 4),
            # the coordinator's sends as a share of the step (issue 26 item 7: a store in
            # the stages is worth it above 3%)
            "send_share": round(med("perf/transport_send_s") / step_s, 4) if step_s else 0.0,
        },
        "reward_mean": [
            round(rows[0].get("reward/mean", 0.0), 4),
            round(rows[-1].get("reward/mean", 0.0), 4),
        ],
    }

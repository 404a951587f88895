"""`python bench/actor_profile.py [--config grpo-gpu-real] [--rows 64] [--top 25]`: where
the actor's `update` spends a micro-batch (issue 25: training is most of a
`grpo-gpu-real` step), on one GPU.

Builds the actor role with the preset's own options (model, dtype, autocast, token
budget, log-prob chunks), feeds it one micro-batch shaped like the preset's: `--rows`
rows, left-padded prompts of 60-110 tokens, responses at log-normal lengths (median 256,
sigma 0.75, capped at 1024, as the native rollout's forced lengths), seeded random ids,
advantages, rollout and reference log-probs. One warm-up `update`, then `--steps` timed
updates (wall, tokens/s, the usual 6*N*tokens MFU estimate against 989.5 TFLOP/s, and
the step's grad norm: NaN means the updates were skipped), then
one update under torch.profiler: prints one JSON object with the timings and the
`--top` CUDA ops by self device time (name, calls, ms) and the summed kernel time.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import yaml

PEAK = 989.5e12


def _batch(rows: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(60, 111, (rows,), generator=g)
    rlen = torch.exp(math.log(256) + 0.75 * torch.randn(rows, generator=g)).long().clamp(1, 1024)
    p, r = int(plen.max()), int(rlen.max())
    pm = (torch.arange(p)[None, :] >= (p - plen)[:, None]).long()
    rm = (torch.arange(r)[None, :] < rlen[:, None]).long()
    return {
        "prompt_ids": torch.randint(0, vocab, (rows, p), generator=g) * pm,
        "prompt_mask": pm,
        "response_ids": torch.randint(0, vocab, (rows, r), generator=g) * rm,
        "response_mask": rm,
        "advantages": torch.randn(rows, r, generator=g) * rm,
        "rollout_logprobs": -torch.rand(rows, r, generator=g) * 5 * rm,
        "ref_logprobs": -torch.rand(rows, r, generator=g) * 5 * rm,
    }


def _forwards(role: Any, mb: dict[str, torch.Tensor]) -> list[list[int]]:
    """[rows, positions computed] of each forward the update runs on `mb` (padded: rows x
    the group's widest prompt + response span; packed: its real tokens)."""
    from hybridflow.stages.packing import group_batch, response_span

    out = []
    for rows in role._groups(mb):
        sub = group_batch(mb, rows)
        n = int(sub["prompt_mask"].shape[0])
        if role.opts.pack_sequences:
            pos = int(sub["prompt_mask"].sum() + response_span(sub["response_mask"]).sum())
        else:
            pos = n * (sub["prompt_mask"].shape[1] + sub["response_mask"].shape[1])
        out.append([n, pos])
    return out


def _gemms(prof: Any, top: int) -> list[list[Any]]:
    """[op, [a, b], calls, device ms, TFLOP/s] of the `top` GEMM shapes by device time
    (aten::mm / addmm / bmm: 2*m*n*k FLOPs per call): is the update's GEMM time spent at
    a good rate, or in shapes that run far below peak?"""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key not in ("aten::mm", "aten::addmm", "aten::bmm"):
            continue
        dt = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        first = 1 if e.key == "aten::addmm" else 0  # addmm(bias, a, b); mm/bmm(a, b[, out])
        shapes = list(e.input_shapes)[first : first + 2]
        if dt <= 0 or len(shapes) < 2 or not all(shapes):
            continue
        a, b = shapes  # [.., m, k] x [.., k, n]
        flops = 2 * math.prod(a) * b[-1] * e.count
        rows.append([e.key, [a, b], e.count, round(dt / 1e3, 2), round(flops / (dt * 1e6), 1)])
    rows.sort(key=lambda r: -r[3])
    return rows[:top]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="grpo-gpu-real")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--set", action="append", default=[], help="actor option KEY=VALUE (YAML)")
    ap.add_argument(
        "--gemms", type=int, default=0, help="also list the N slowest GEMM shapes (TFLOP/s)"
    )
    args = ap.parse_args(argv)
    import hybridflow.config as cfgpkg
    from hybridflow.stages.actor import Actor
    from hybridflow.stages.base import StageContext

    preset = Path(cfgpkg.__file__).parent / "presets" / f"{args.config}.yaml"
    doc = yaml.safe_load(preset.read_text())
    options = dict(doc["stages"]["engine"]["roles"]["actor"]["options"])
    for kv in args.set:
        k, v = kv.split("=", 1)
        options[k] = yaml.safe_load(v)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a smoke run
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    ctx = StageContext(
        stage="actor", replica=0, device=dev, seed=0, run_dir=Path("/tmp"), options=options
    )
    role = Actor()
    role.setup(ctx)
    params = sum(p.numel() for p in role.model.parameters())
    vocab = int(role.model.config.vocab_size)
    mb = _batch(args.rows, vocab, 0)
    tokens = int(mb["prompt_mask"].sum() + mb["response_mask"].sum())
    role.handle("update", mb, {})
    role.handle("optimizer_step", {}, {})
    sync()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        role.handle("update", mb, {})
        sync()
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    step = role.handle("optimizer_step", {}, {})[1]
    sync()
    opt_s = time.perf_counter() - t0
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts, record_shapes=args.gemms > 0) as prof:
        role.handle("update", mb, {})
        sync()
    rows, kernel_us = [], 0.0
    for e in prof.key_averages():
        dt = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if dt > 0:
            rows.append([e.key[:90], e.count, round(dt / 1e3, 2)])
        if e.device_type != torch.autograd.DeviceType.CPU:  # a kernel, not the op above it
            kernel_us += dt
    rows.sort(key=lambda r: -r[2])
    upd = min(times)
    out: dict[str, Any] = {
        "config": args.config,
        "options": {k: options.get(k) for k in sorted(options) if k != "model_overrides"},
        "params": params,
        "rows": args.rows,
        "tokens": tokens,
        "response_tokens": int(mb["response_mask"].sum()),
        "update_s": round(upd, 4),
        # every timed update: session 18 saw one configuration take 0.73 s in one process
        # and 0.96 s in another, so the spread is reported, not just the best
        "update_s_all": [round(t, 4) for t in times],
        "optimizer_step_s": round(opt_s, 4),
        # a NaN norm means the updates were skipped (session 17 found cuDNN attention's)
        "grad_norm": step.get("actor/grad_norm"),
        "skipped_updates": step.get("actor/skipped_updates"),
        "forwards": _forwards(role, mb),  # [rows, positions] each
        "tokens_per_s": round(tokens / upd, 1),
        "mfu": round(6 * params * tokens / upd / PEAK, 4),
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if dev.type == "cuda"
        else None,
        # kernels only: `top` lists ops and their kernels both (an op's self device time
        # is its kernels'), so its sum counts most time twice
        "device_ms": round(kernel_us / 1e3, 1),
        "top": rows[: args.top],
    }
    if args.gemms:
        out["gemms"] = _gemms(prof, args.gemms)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m hybridflow.bench.native_engine --json`: decode throughput of the native
rollout engine (hybridflow/stages/rollout/native) for one model preset.

For each number of concurrent sequences N (--seqs, e.g. 64,128,256,512) and each decode
mode (CUDA graphs on / off; on CPU only off), the engine generates exactly
--max-new-tokens tokens for N random prompts of --prompt-len tokens (stop tokens ignored,
so every configuration does the same work), temperature --temperature, the N rows split
into requests of --request-rows rows that all enter at once (continuous batching across
requests). One short untimed run warms up first. Reported per configuration:

  tokens_per_s      generated tokens / wall seconds of the whole run (prefill included)
  decode_tokens_per_s   N / median decode step time (steady state, no prefill)
  step_ms           median wall time of one decode step (host sync included)
  prefill_s         wall time of the first engine step (prefill of all N rows + 1 decode)
  capture_s         CUDA-graph capture time (graphs mode)
  peak_mem_gb       torch.cuda.max_memory_allocated during the run (GPU)
  kv_cache_gb       the KV cache allocated for N slots
  decode_path       module | fused | compiled (--paths; each configuration runs per path)
  forward_kernels   CUDA kernels one decode step's forward launches (torch.profiler over
                    one eager forward; a CUDA graph replays the same kernels), their summed
                    time (forward_kernel_us) and the costliest (forward_top: name,
                    launches, µs); sampler_* the same for the sampling step (GPU)
  lookahead_rows    finished rows decoded once more (--lookahead on)
  mean_running_rows rows decoding together on average (timed run; async: warm-up included):
                    with --kv-cache-gb fixed, what the layout fits against kv_slots
With --rows R > N the R rows queue for N slots and are admitted as rows finish; with
--length-median each row stops at its own log-normal length (the mix of RL responses):
then tokens_per_s over the whole run is the figure, step_ms a median of mixed steps.
With --frontend async (CUDA graphs only) the same run also goes through `AsyncEngine`:
every request submitted at once from an event loop, stepped by the engine thread, as the
role's concurrent `generate` calls run it; `step_ms` there is wall / steps.

Without a CUDA device only the eager, synchronous runs are measured and `skipped` says what
was left out. --quick: the same runs at N = 2,4, 8 new tokens, requests of 2 rows.
Default model: `tiny` on CPU, float32. GPU example (the number the project tracks):
  python -m hybridflow.bench.native_engine --json --model qwen2-0.5b --vocab-size 192 \\
      --dtype bfloat16 --seqs 64,128,256,512
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from typing import Any

import torch

from hybridflow.bench import with_options
from hybridflow.models.loader import ModelOptions, load_model, load_tokenizer
from hybridflow.stages.rollout.native.engine import EngineConfig, NativeEngine
from hybridflow.stages.rollout.native.forward.shared_prefix import PREFIX_MIN_SAVED
from hybridflow.stages.rollout.native.frontend import AsyncEngine
from hybridflow.stages.rollout.native.request import Request, SamplingParams
from hybridflow.stages.rollout.native.role import lognormal_lengths

GIB = float(1 << 30)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hybridflow.bench.native_engine", description=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object (the default)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--vocab-size", type=int, default=0, help="override the preset's vocab")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (GPU default bfloat16)")
    p.add_argument("--seqs", default="", help="comma-separated N (default 64,128,256,512)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--request-rows", type=int, default=64)
    p.add_argument("--graphs", choices=("both", "on", "off"), default="both")
    p.add_argument(
        "--frontend",
        choices=("sync", "async"),
        default="async",
        help="async: also measure through AsyncEngine (graphs mode)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--paths",
        default="fused",
        help="decode paths, comma-separated: module (the HF modules' ops), fused "
        "(native/forward/fused.py), compiled (fused, its elementwise parts through torch.compile; "
        "CUDA only)",
    )
    p.add_argument(
        "--fp32-lm-head", action="store_true", help="the output head in float32 (models/heads.py)"
    )
    p.add_argument(
        "--decode-lengths",
        default="",
        help="attention length buckets, comma-separated (default 64,128,...; a value >= "
        "prompt + new tokens: whole slots)",
    )
    p.add_argument(
        "--kv-block-size", type=int, default=0, help="paged KV in blocks of this size (0: slots)"
    )
    p.add_argument(
        "--samples",
        type=int,
        default=1,
        help="rows per prompt (GRPO's n): N / samples prompts, each sampled this many times",
    )
    p.add_argument(
        "--shared-prefix",
        choices=("auto", "on", "off"),
        default="auto",
        help="paged KV: a prompt's rows read its shared blocks once per step (cascade): "
        "where it saves enough (auto), always (on) or never (off)",
    )
    p.add_argument(
        "--lookahead",
        choices=("on", "off"),
        default="off",
        help="queue each decode step before reading which rows the last one finished "
        "(engine.py 'Lookahead')",
    )
    p.add_argument(
        "--decode-kernels",
        choices=("on", "off"),
        default="on",
        help="the Triton RoPE+KV-write and sampling kernels (EngineConfig.rope_kernel, "
        "sample_kernel); off: the compiled torch functions and the torch sampler",
    )
    p.add_argument(
        "--length-median",
        type=int,
        default=0,
        help="> 0: each row stops at a log-normal length of this median (--length-sigma), "
        "capped at --max-new-tokens, as real responses do (0: every row runs to the cap)",
    )
    p.add_argument("--length-sigma", type=float, default=0.75)
    p.add_argument(
        "--kv-cache-gb",
        type=float,
        default=0.0,
        help="the KV budget (0: 64 GiB on CUDA, 4 on CPU); slots = min(N, budget // slot)",
    )
    p.add_argument(
        "--rows",
        type=int,
        default=0,
        help="rows in all (0: N): more than N queue for the N slots, admitted as rows finish",
    )
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark; `args` may come from `hybridflow bench` (--json/--quick, options as
    --set KEY=VALUE): the options it lacks take this module's defaults, and --quick
    shrinks the run."""
    args = with_options(args, vars(parse([])), "native_engine")
    if getattr(args, "quick", False):
        # Every path of the full run at small sizes: two batch sizes, the larger one split
        # into two requests (continuous batching across requests), both decode modes and
        # both frontends where the device has them.
        args.seqs, args.max_new_tokens = args.seqs or "2,4", min(args.max_new_tokens, 8)
        args.request_rows = min(args.request_rows, 2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    seqs = [int(s) for s in args.seqs.split(",") if s] or [64, 128, 256, 512]
    overrides = {"vocab_size": args.vocab_size} if args.vocab_size else {}
    tokenizer = load_tokenizer("builtin")
    opts = ModelOptions(
        model=args.model,
        tokenizer="builtin",
        dtype=dtype,  # type: ignore[arg-type]
        init_device="device",
        model_overrides=overrides,
        fp32_lm_head=bool(getattr(args, "fp32_lm_head", False)),
    )
    t0 = time.perf_counter()
    model = load_model(opts, tokenizer, device=device, seed=args.seed)
    model.requires_grad_(False)
    out: dict[str, Any] = {
        "bench": "native_engine",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": args.model,
        "vocab_size": model.config.vocab_size,
        "dtype": dtype,
        "fp32_lm_head": opts.fp32_lm_head,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "build_s": round(time.perf_counter() - t0, 2),
        "torch": torch.__version__,
        "results": [],
    }
    modes = {"both": [True, False], "on": [True], "off": [False]}[args.graphs]
    out["skipped"] = []
    if device.type != "cuda":
        if True in modes:
            out["skipped"].append("cuda_graphs: no CUDA device")
        if args.frontend == "async":
            out["skipped"].append("async frontend: measured with CUDA graphs only")
        modes = [False]
    paths = [x for x in str(getattr(args, "paths", "fused")).split(",") if x]
    for bad in set(paths) - set(PATHS):
        raise SystemExit(f"--paths: {bad!r} is not one of {', '.join(PATHS)}")
    if device.type != "cuda" and "compiled" in paths:
        out["skipped"].append("compiled decode path: CUDA only")
        paths = [x for x in paths if x != "compiled"]
    for path in paths:
        for graphs in modes:
            for n in seqs:
                fronts = ["sync", "async"] if graphs and args.frontend == "async" else ["sync"]
                for front in fronts:
                    out["results"].append(_measure(model, n, graphs, args, device, front, path))
                    print(json.dumps(out["results"][-1]), file=sys.stderr, flush=True)
    return out


PATHS = ("module", "fused", "compiled")


def _kernels(engine: NativeEngine, n: int) -> dict[str, Any]:
    """CUDA kernels of one eager decode forward and one sampling step over n rows (run
    between requests: rows 0..n-1 are free, their writes land in free slots), and the
    forward's and sampler's costliest kernels (name, launches, total µs)."""
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, Any] = {}
    length = engine.lengths[0]
    parts = {
        "forward": lambda: engine._forward(n, length),
        "sampler": lambda: engine._sample(n, False),
    }
    for name, fn in parts.items():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out[f"{name}_kernels"] = len(kernels)
        out[f"{name}_kernel_us"] = round(sum(_us(e) for e in kernels), 1)
        by: dict[str, list[float]] = {}
        for e in kernels:
            by.setdefault(e.name[:80], []).append(_us(e))
        top = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:8]
        out[f"{name}_top"] = [[k, len(v), round(sum(v), 1)] for k, v in top]
    return out


def _us(event: Any) -> float:
    return float(getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0))


def _measure(
    model: Any,
    n: int,
    graphs: bool,
    args: argparse.Namespace,
    device: torch.device,
    frontend: str = "sync",
    path: str = "fused",
) -> dict[str, Any]:
    """One configuration: a warm-up run, then the timed run of N sequences."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    config = _engine_config(n, graphs, args, device)
    config = dataclasses.replace(
        config, fused_decode=path != "module", compile_decode=path == "compiled"
    )
    t0 = time.perf_counter()
    engine = NativeEngine(model, config)
    setup_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(args.seed)  # warm-up prompts first, then the run's

    def requests(max_new: int) -> list[Request]:
        return _requests(n, args, gen, model.config.vocab_size, max_new)

    before = dict.fromkeys(engine.stats, 0.0)  # async: the warm-up's steps counted too
    if frontend == "async":
        wall, times, tokens = _through_async(engine, requests(8), requests(args.max_new_tokens))
    else:
        _drive(engine, requests(8))  # warm-up: allocator, kernels, prefill shapes
        before = dict(engine.stats)
        wall, times, tokens = _drive(engine, requests(args.max_new_tokens))
    run = {k: engine.stats[k] - before[k] for k in engine.stats}
    kernels = _kernels(engine, n) if device.type == "cuda" and frontend == "sync" else None
    step = statistics.median(times[1:]) if len(times) > 1 else times[0]
    result = {
        "seqs": n,
        "frontend": frontend,
        "decode_path": path,  # as asked; "fused_off" says why a model could not take it
        "cuda_graphs": engine.graphs is not None,
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "decode_tokens_per_s": round(n / step, 1),
        "step_ms": round(step * 1e3, 3),
        "prefill_s": round(times[0], 4),
        "wall_s": round(wall, 3),
        "capture_s": round(engine.stats["capture_s"], 3),
        "setup_s": round(setup_s, 3),  # engine build + capture (compiling, if compiled)
        "kv_cache_gb": round(engine.cache.nbytes / GIB, 4),
        "decode_lengths": engine.lengths,
        "kv_block_size": engine.paged.block if engine.paged is not None else 0,
        "samples": int(getattr(args, "samples", 1) or 1),
        "rows": int(getattr(args, "rows", 0) or 0) or n,
        "length_median": int(getattr(args, "length_median", 0) or 0),
        "lookahead": engine.lookahead,
        "decode_kernels": engine.sampler.kernels,
        "lookahead_rows": run["lookahead_rows"],
        "preemptions": run["preemptions"],
        # rows decoding together on average: with a length mix and a fixed budget, how many
        # sequences the KV layout fits (slots reserve max_model_len each; paged, what rows
        # hold); kv_slots: the slot layout's count for the budget (paged: max_num_seqs)
        "mean_running_rows": round(run["decode_tokens"] / max(1, run["steps"]), 1),
        "decode_steps": int(run["steps"]),
        "kv_slots": engine.num_slots,
        "kv_blocks_peak": engine.paged.peak_blocks if engine.paged is not None else 0,
        # share of decoded rows that read their prompt's blocks once per group (cascade)
        "shared_prefix_share": round(
            engine.stats["shared_prefix_rows"] / max(1, engine.stats["decode_tokens"]), 3
        ),
    }
    if device.type == "cuda":
        result["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(device) / GIB, 3)
    if path != "module" and engine.fused_off is not None:
        result["fused_off"] = engine.fused_off
    if kernels is not None:
        result.update(kernels)
    engine.release()
    return result


def _engine_config(
    n: int, graphs: bool, args: argparse.Namespace, device: torch.device
) -> EngineConfig:
    return EngineConfig(
        max_model_len=args.prompt_len + args.max_new_tokens,
        kv_cache_gb=float(getattr(args, "kv_cache_gb", 0) or 0)
        or (64.0 if device.type == "cuda" else 4.0),
        max_num_seqs=n,
        cuda_graphs=graphs,
        # ignore-EOS rows all finish together: one bucket is used (a length mix: all)
        graph_batch_sizes=() if getattr(args, "length_median", 0) else (n,),
        max_prefill_tokens=max(8192, n * args.prompt_len),
        decode_lengths=tuple(
            int(x) for x in str(getattr(args, "decode_lengths", "") or "").split(",") if x
        ),
        kv_block_size=int(getattr(args, "kv_block_size", 0) or 0),
        shared_prefix=getattr(args, "shared_prefix", "auto") != "off",
        shared_prefix_min_saved=(
            0 if getattr(args, "shared_prefix", "auto") == "on" else PREFIX_MIN_SAVED
        ),
        lookahead=getattr(args, "lookahead", "off") == "on",
        rope_kernel=getattr(args, "decode_kernels", "on") == "on",
        sample_kernel=getattr(args, "decode_kernels", "on") == "on",
    )


def _requests(
    n: int, args: argparse.Namespace, gen: torch.Generator, vocab: int, max_new: int
) -> list[Request]:
    """--rows (default N) rows: rows / --samples random prompts of --prompt-len tokens,
    each sampled --samples times, in requests of --request-rows rows; with
    --length-median, each row capped at its own log-normal length."""
    k = max(1, int(getattr(args, "samples", 1) or 1))
    n = int(getattr(args, "rows", 0) or 0) or n
    if n % k or max(1, args.request_rows) % k:
        raise SystemExit(f"--samples {k} must divide the rows ({n}) and --request-rows")
    prompts = torch.randint(2, vocab, (n // k, args.prompt_len), generator=gen)
    median = int(getattr(args, "length_median", 0) or 0)
    caps = lognormal_lengths(median, args.length_sigma, max_new, n, args.seed) if median else None
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=max_new,
        n=k,
    )
    per = max(1, args.request_rows) // k  # prompts per request
    return [
        Request(
            list(prompts[i : i + per]),
            params,
            seed=args.seed + i,
            max_new_tokens=None if caps is None else caps[i * k : (i + per) * k],
        )
        for i in range(0, n // k, per)
    ]


def _drive(engine: NativeEngine, reqs: list[Request]) -> tuple[float, list[float], int]:
    """Every request at once, stepped synchronously -> (wall s, each step's s, tokens)."""
    for r in reqs:
        engine.add_request(r)
    times: list[float] = []
    tokens = 0
    t_start = time.perf_counter()
    while engine.has_work():
        t = time.perf_counter()
        for o in engine.step():
            tokens += int(o.lengths.sum())
        times.append(time.perf_counter() - t)
    return time.perf_counter() - t_start, times, tokens


def _through_async(
    engine: NativeEngine, warm_up: list[Request], reqs: list[Request]
) -> tuple[float, list[float], int]:
    """`_drive`'s numbers through AsyncEngine (the role's frontend), after a warm-up; the
    step times are [0, wall / steps] (the engine thread steps, unseen from here)."""
    front = AsyncEngine(engine)
    try:
        asyncio.run(_through_frontend(front, warm_up))
        steps0 = engine.stats["steps"]
        wall, tokens = asyncio.run(_through_frontend(front, reqs))
        steps = engine.stats["steps"] - steps0
    finally:
        front.close()
    return wall, [0.0, wall / max(1, steps)], tokens


async def _through_frontend(front: AsyncEngine, reqs: list[Request]) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(front.generate(r) for r in reqs))
    return time.perf_counter() - t0, sum(int(o.lengths.sum()) for o in outs)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Multi-turn generation against single-turn on the native engine, same model, same batch.

    python bench/multiturn.py                       # CPU: the tiny model, a few sequences
    python bench/multiturn.py --device cuda:0 --model qwen2-0.5b --vocab-size 151936 \\
        --seqs 256 --turns 4 --turn-tokens 128 --obs-tokens 32 --latency-ms 50

Every trajectory of the `fixed_turns` environment (stages/env/builtin/fixed_turns.py) is
`--turns` model turns of exactly `--turn-tokens` tokens (stop tokens ignored), each but
the last answered after `--latency-ms` by an observation of `--obs-tokens` ids. The
single-turn baseline generates `turns x turn-tokens` tokens per row in one go, for the
same rows. Both go through the native rollout role's `generate` (rollout/native/role.py),
as a training step calls it. One untimed run of each warms up first. Printed (JSON):

  single.tokens_per_s       model tokens / wall seconds, single turn
  multi.tokens_per_s        model tokens / wall seconds of the trajectory loop (env waits
                            included: that is what a rollout phase costs)
  ratio                     multi / single
  multi.prefill_saved_frac  context positions taken from parked K/V / all context positions
  multi.env_time_share      mean share of a trajectory's wall time spent in env calls
  no_reuse.*                the multi-turn run with reuse_kv: false (every turn re-prefills)
  *.engine_busy_s           seconds inside engine steps (the rest of wall_s it was idle:
                            waiting on environments or on the loop); engine_steps: decode
                            steps; engine_prefill_tokens: positions prefilled
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hybridflow.data.batching import encode_metadata
from hybridflow.stages.base import StageContext
from hybridflow.stages.rollout.native.role import NativeRollout


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--vocab-size", type=int, default=0, help="override the preset's vocab")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, else float32")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=8)
    ap.add_argument("--obs-tokens", type=int, default=4)
    ap.add_argument("--latency-ms", type=float, default=0.0)
    ap.add_argument("--kv-cache-gb", type=float, default=0.1)
    ap.add_argument("--runs", default="single,multi,no_reuse", help="which runs, in order")
    ap.add_argument(
        "--switch-interval-ms",
        type=float,
        default=0.0,
        help="set sys.setswitchinterval after the role's setup (0: leave the role's)",
    )
    ap.add_argument(
        "--gather-ms", type=float, default=None, help="admission_gather_ms (default: the role's)"
    )
    ap.add_argument(
        "--hold-ms", type=float, default=None, help="burst_hold_ms (default: the role's)"
    )
    ap.add_argument(
        "--profile",
        default="",
        help="write a torch.profiler table of the timed calls (labels: the engine's parts)",
    )
    ap.add_argument(
        "--trace", action="store_true", help="time every engine step: where the time goes"
    )
    return ap.parse_args(argv)


def role(args: argparse.Namespace, **options: Any) -> NativeRollout:
    gpu = args.device.startswith("cuda")
    positions = args.prompt_len + args.turns * (args.turn_tokens + args.obs_tokens)
    opts: dict[str, Any] = {
        "model": args.model,
        "tokenizer": "builtin",
        "dtype": args.dtype or ("bfloat16" if gpu else "float32"),
        "temperature": 1.0,
        "stop_on_eos": False,
        "max_prompt_len": positions,
        "kv_cache_gb": args.kv_cache_gb,
        "max_num_seqs": args.seqs,
        **options,
    }
    if args.vocab_size:
        opts["model_overrides"] = {"vocab_size": args.vocab_size}
    ctx = StageContext(
        stage="rollout",
        replica=0,
        device=torch.device(args.device),
        seed=0,
        run_dir=Path("."),
        options=opts,
    )
    r = NativeRollout()
    r.setup(ctx)
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    return r


def batch(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 100, (args.seqs, args.prompt_len), generator=g)
    return {
        "prompt_ids": ids,
        "prompt_mask": torch.ones_like(ids),
        "metadata_json": encode_metadata([{"id": i} for i in range(args.seqs)]),
    }


def trace_steps(core: Any, log: list[tuple[float, float, int, int]]) -> None:
    """Wrap `core.step` (on the engine's thread): per step (start, seconds, rows decoded,
    rows admitted). Each step ends in a host sync, so its wall time is its device time."""
    step = core.step

    def timed_step() -> Any:
        rows0, t0 = core.stats["prefill_rows"], time.perf_counter()
        out = step()
        t1 = time.perf_counter()
        log.append((t0, t1 - t0, core.scheduler.active, core.stats["prefill_rows"] - rows0))
        return out

    core.step = timed_step


def label_parts(core: Any) -> None:
    """record_function labels around the engine's parts, for --profile's table."""
    from hybridflow.stages.rollout.native import engine as engine_mod

    def labelled(name: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            with torch.profiler.record_function(name):
                return fn(*a, **k)

        return call

    for name in ("_prefill", "_apply", "_retire", "_row_params"):
        setattr(core, name, labelled(f"engine.{name}", getattr(core, name)))
    for name in ("prompt_logits", "sample", "row_uniform"):
        setattr(engine_mod, name, labelled(f"engine.{name}", getattr(engine_mod, name)))
    if core.graphs is not None:
        core.graphs.replay = labelled("engine.graph_replay", core.graphs.replay)
    core.model.extend = labelled("model.extend", core.model.extend)
    core.model.prefill = labelled("model.prefill", core.model.prefill)
    core.cache.move = labelled("cache.move", core.cache.move)
    core.cache.init_rows = labelled("cache.init_rows", core.cache.init_rows)


def trace_summary(log: list[tuple[float, float, int, int]]) -> dict[str, float]:
    adm = [x for x in log if x[3]]
    dec = [x for x in log if not x[3]]
    gaps = [b[0] - (a[0] + a[1]) for a, b in itertools.pairwise(log)]
    return {
        "steps": len(log),
        "decode_only_steps": len(dec),
        "decode_only_s": sum(x[1] for x in dec),
        "decode_only_ms_per_step": 1e3 * sum(x[1] for x in dec) / max(1, len(dec)),
        "admission_steps": len(adm),
        "admission_s": sum(x[1] for x in adm),
        "admitted_rows_per_admission": sum(x[3] for x in adm) / max(1, len(adm)),
        "idle_gaps_s": sum(gaps),
        "idle_gaps_over_5ms": sum(1 for g in gaps if g > 0.005),
        "rows_decoded_mean": sum(x[2] for x in log) / max(1, len(log)),
    }


def timed(
    r: NativeRollout,
    b: dict[str, torch.Tensor],
    step: int,
    trace: bool = False,
    profile: str = "",
) -> dict[str, Any]:
    r.handle("generate", b, {"step": -1 - step, "mb_id": 0})  # warm-up
    assert r.engine is not None
    log: list[tuple[float, float, int, int]] = []
    if trace:
        r.engine.call(lambda core: trace_steps(core, log))
    before = r.engine.call(lambda core: dict(core.stats))
    prof = None
    if profile:
        r.engine.call(label_parts)
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]
            + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        )
        # Entered on the engine's thread: the profiler records the thread it starts on.
        r.engine.call(lambda core: prof.__enter__())
    t0 = time.perf_counter()
    out, metrics = r.handle("generate", b, {"step": step, "mb_id": 0})
    wall = time.perf_counter() - t0
    if prof is not None:
        r.engine.call(lambda core: prof.__exit__(None, None, None))
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
        if torch.cuda.is_available():
            table += "\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        Path(f"{profile}.{step}.txt").write_text(table)
    after = r.engine.call(lambda core: dict(core.stats))
    tokens = int(out["response_mask"].sum())
    res: dict[str, Any] = {"wall_s": wall, "model_tokens": tokens, "tokens_per_s": tokens / wall}
    if trace:
        res["trace"] = trace_summary(log)
    # engine_busy_s: inside the engine's steps; the rest of wall_s the engine had no work
    for key in ("busy_s", "steps", "prefill_tokens", "prefill_rows"):
        res[f"engine_{key}"] = after[key] - before[key]
    for key, name in (
        ("rollout/turns/mean", "turns"),
        ("rollout/prefill_saved_frac", "prefill_saved_frac"),
        ("rollout/reused_tokens", "reused_tokens"),
        ("rollout/context_tokens", "context_tokens"),
        ("env/time_share", "env_time_share"),
        ("rollout/obs_token_frac", "obs_token_frac"),
        ("rollout/peak_mem_gb", "peak_mem_gb"),
    ):
        if key in metrics:
            res[name] = metrics[key]
    r.close()
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    env = {
        "env": "fixed_turns",
        "env_options": {
            "turns": args.turns,
            "obs_tokens": args.obs_tokens,
            "latency_s": args.latency_ms / 1000,
        },
        "max_turns": args.turns,
        **({} if args.gather_ms is None else {"admission_gather_ms": args.gather_ms}),
        **({} if args.hold_ms is None else {"burst_hold_ms": args.hold_ms}),
        "env_concurrency": args.seqs,
        "max_new_tokens": args.turn_tokens,
    }
    b = batch(args)
    runs = {
        "single": lambda: role(args, max_new_tokens=args.turns * args.turn_tokens),
        "multi": lambda: role(args, **env),
        "no_reuse": lambda: role(args, **env, reuse_kv=False),
    }
    result: dict[str, Any] = {"bench": "multiturn", "settings": vars(args)}
    for i, name in enumerate(args.runs.split(",")):
        result[name] = timed(runs[name](), b, i, args.trace, args.profile)
    for name in ("multi", "no_reuse"):
        if name in result and "single" in result:
            ratio = result[name]["tokens_per_s"] / result["single"]["tokens_per_s"]
            result["ratio" if name == "multi" else "ratio_no_reuse"] = ratio
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

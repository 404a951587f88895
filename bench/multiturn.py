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
    return r


def batch(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 100, (args.seqs, args.prompt_len), generator=g)
    return {
        "prompt_ids": ids,
        "prompt_mask": torch.ones_like(ids),
        "metadata_json": encode_metadata([{"id": i} for i in range(args.seqs)]),
    }


def timed(r: NativeRollout, b: dict[str, torch.Tensor], step: int) -> dict[str, float]:
    r.handle("generate", b, {"step": -1 - step, "mb_id": 0})  # warm-up
    assert r.engine is not None
    before = r.engine.call(lambda core: dict(core.stats))
    t0 = time.perf_counter()
    out, metrics = r.handle("generate", b, {"step": step, "mb_id": 0})
    wall = time.perf_counter() - t0
    after = r.engine.call(lambda core: dict(core.stats))
    tokens = int(out["response_mask"].sum())
    res = {"wall_s": wall, "model_tokens": tokens, "tokens_per_s": tokens / wall}
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
        result[name] = timed(runs[name](), b, i)
    for name in ("multi", "no_reuse"):
        if name in result and "single" in result:
            ratio = result[name]["tokens_per_s"] / result["single"]["tokens_per_s"]
            result["ratio" if name == "multi" else "ratio_no_reuse"] = ratio
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

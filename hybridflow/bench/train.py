"""`hybridflow bench train --json`: training throughput of the actor as FSDP2 ranks.

For each rank count (and gradient reduce dtype), spawns that many processes, each rank
of one sharded actor (the same `Actor` role and `stages/parallel/` code a pipeline
runs), feeds it seeded random sequences (`--rows` per micro-batch, split over the ranks
as the scheduler splits them, `--micro-batches` per step) and times `update` x M +
`optimizer_step` after one warm-up step. Reports per configuration:

  tokens_per_s       prompt+response tokens trained per second, all ranks together
  mfu                6 * parameters * tokens/s / (ranks * peak bf16 dense FLOP/s), the
                     usual estimate (attention FLOPs left out); only on a GPU whose
                     peak is known (H100/H200: 989.5 TFLOP/s), else null
  peak_mem_gb        per rank, torch.cuda.max_memory_allocated (null on CPU)
  grad_bytes_per_step  bytes each rank sends in gradient reduce-scatters per step,
                     computed from the parameter count and reduce dtype ((N-1)/N of the
                     gradient per backward), not counted on the wire
  losses, final_param_checksum  per-step actor/pg_loss and the sum of all parameters,
                     to compare reduce dtypes on the same data
  gather_s, gather_extra_gb  reshard from shards: walking `weight_buckets()` once (every
                     parameter all-gathered, one bucket of full tensors alive at a time,
                     as the reshard does), the slowest rank's seconds, and the most
                     memory any rank held above its resting state meanwhile (null on CPU)

  python -m hybridflow.bench.train --json --model qwen2-1.5b --ranks 1 \\
      --rows 16 --prompt-len 64 --response-len 448
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PEAK_BF16 = {"H100": 989.5e12, "H200": 989.5e12}  # dense, per GPU
GIB = float(1 << 30)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hybridflow.bench.train", description=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object (the default)")
    p.add_argument("--model", default="tiny", help="model preset (tiny, qwen2-0.5b, ...)")
    p.add_argument("--ranks", default="", help="comma-separated rank counts (default 1,2)")
    p.add_argument("--reduce-dtypes", default="float32", help="e.g. float32,bfloat16")
    p.add_argument("--param-dtype", default="", help="FSDP compute dtype (GPU default bf16)")
    p.add_argument("--rows", type=int, default=8, help="sequences per micro-batch (all ranks)")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--fp32-lm-head", action="store_true", help="the LM head in float32")
    p.add_argument("--vocab-size", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _batches(args: argparse.Namespace, vocab: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(args.seed)
    out = []
    for _ in range(args.micro_batches):
        b, p, r = args.rows, args.prompt_len, args.response_len
        out.append(
            {
                "prompt_ids": torch.randint(4, vocab, (b, p), generator=g),
                "prompt_mask": torch.ones(b, p, dtype=torch.int64),
                "response_ids": torch.randint(4, vocab, (b, r), generator=g),
                "response_mask": torch.ones(b, r, dtype=torch.int64),
                "advantages": torch.randn(b, r, generator=g),
            }
        )
    return out


def _rank(rank: int, world: int, init: str, cfg: dict[str, Any], out: str) -> None:
    from hybridflow.pipeline.runtime.scheduler import shard_rows
    from hybridflow.stages.actor import Actor
    from hybridflow.stages.base import StageContext, StageWorld
    from hybridflow.stages.parallel.fsdp import local_numel
    from hybridflow.stages.parallel.group import Group, exit_rank

    args = argparse.Namespace(**cfg["args"])
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(max(1, torch.get_num_threads() // world))
    options: dict[str, Any] = {
        "model": args.model,
        "tokenizer": "builtin",
        "lr": 1e-5,
        "init_device": "device",
        "fsdp": True,
        "fsdp_reduce_dtype": cfg["reduce_dtype"],
        "fsdp_cpu_offload": args.cpu_offload,
        "gradient_checkpointing": args.gradient_checkpointing,
        "fp32_lm_head": bool(getattr(args, "fp32_lm_head", False)),
    }
    if cfg["param_dtype"]:
        options["fsdp_param_dtype"] = cfg["param_dtype"]
    if args.vocab_size:
        options["model_overrides"] = {"vocab_size": args.vocab_size}
    world_info = StageWorld(role="actor", rank=rank, world_size=world, init_method=init)
    ctx = StageContext(
        "bench", rank, device, args.seed, Path(out), options=options, world=world_info
    )
    actor = Actor()
    actor.setup(ctx)
    numel = int(Group(rank, world, device).sum([float(local_numel(actor.model))])[0])
    batches = _batches(args, actor.model.config.vocab_size)
    losses, times = [], []
    for step in range(args.steps + 1):
        if cuda:
            torch.cuda.synchronize(device)
            if step == 1:
                torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        for mb in batches:
            actor.handle("update", shard_rows(mb, world, rank), {})
        metrics = actor.handle("optimizer_step", {}, {})[1]
        if cuda:
            torch.cuda.synchronize(device)
        if step > 0:
            times.append(time.perf_counter() - t0)
        losses.append(metrics["actor/pg_loss"])
    peak = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    gather_s, extra = _gather(actor, device)
    checksum = sum(float(t.double().sum()) for _, t in actor.named_full_weights())
    result = {"rank": rank, "times": times, "losses": losses, "numel": numel, "peak_mem_gb": peak}
    result |= {"checksum": checksum, "gather_s": gather_s, "gather_extra_gb": extra}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    actor.close()
    exit_rank()


def _gather(actor: Any, device: torch.device) -> tuple[float, float | None]:
    """Seconds to walk the weight buckets once, and GiB held above rest meanwhile."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        rest = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    for bucket in actor.weight_buckets():
        del bucket
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    extra = (torch.cuda.max_memory_allocated(device) - rest) / GIB if cuda else None
    return seconds, extra


def measure(args: argparse.Namespace, world: int, reduce_dtype: str) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    param_dtype = args.param_dtype or ("bfloat16" if cuda else "")
    cfg = {"args": vars(args), "reduce_dtype": reduce_dtype, "param_dtype": param_dtype}
    with tempfile.TemporaryDirectory() as out:
        torch.multiprocessing.spawn(
            _rank, args=(world, f"file://{out}/rendezvous", cfg, out), nprocs=world
        )
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    step_s = max(sum(r["times"]) for r in ranks) / args.steps
    tokens = args.rows * args.micro_batches * (args.prompt_len + args.response_len)
    tps = tokens / step_s
    numel = ranks[0]["numel"]
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    size = {"float32": 4, "bfloat16": 2}[reduce_dtype]
    return {
        "ranks": world,
        "reduce_dtype": reduce_dtype,
        "param_dtype": param_dtype or "float32",
        "params": numel,
        "step_s": round(step_s, 4),
        "tokens_per_step": tokens,
        "tokens_per_s": round(tps, 1),
        "mfu": round(6 * numel * tps / (world * peak), 4) if peak else None,
        "peak_mem_gb": [round(r["peak_mem_gb"], 2) if cuda else None for r in ranks],
        "grad_bytes_per_step": int(numel * size * (world - 1) / world * args.micro_batches),
        "losses": ranks[0]["losses"],
        "final_param_checksum": ranks[0]["checksum"],
        "gather_s": round(max(r["gather_s"] for r in ranks), 4),
        "gather_extra_gb": round(max(r["gather_extra_gb"] for r in ranks), 3) if cuda else None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hybridflow.bench import with_options

    args = with_options(args, vars(parse([])), "train")
    if getattr(args, "quick", False):
        args.steps, args.micro_batches = 1, 1
    cuda = torch.cuda.is_available()
    counts = [int(n) for n in args.ranks.split(",") if n] or [1, 2]
    if cuda:
        counts = [n for n in counts if n <= torch.cuda.device_count()]
    out: dict[str, Any] = {
        "bench": "train",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "model": args.model,
        "rows": args.rows,
        "micro_batches": args.micro_batches,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "gradient_checkpointing": args.gradient_checkpointing,
        "cpu_offload": args.cpu_offload,
        "fp32_lm_head": bool(getattr(args, "fp32_lm_head", False)),
        "torch": torch.__version__,
        "results": [
            measure(args, n, rd) for n in counts for rd in args.reduce_dtypes.split(",") if rd
        ],
    }
    return out


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(run(parse(argv)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

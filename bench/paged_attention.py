"""Decode attention per call on one GPU: the slot layout's dense SDPA against the paged
cache's two paths (stages/rollout/native/forward/paged_attention.py).

    python bench/paged_attention.py                      # B=256, both shapes, bf16
    python bench/paged_attention.py --batch 16 --min-len 2000 --max-len 4000 --bucket 4096
    python bench/paged_attention.py --splits 4           # force the kernel's split count
    python bench/paged_attention.py --group 8 --prefix 256 --min-len 300   # GRPO's n = 8

Shapes (one layer's decode attention): qwen2-0.5b (Hkv=2, G=7, D=64) and qwen3-0.6b
(Hkv=8, G=2, D=128). Live lengths uniform in [--min-len, --max-len], the bucket (the slot
path's L) --bucket. The same K/V values are laid out both ways: a slot cache
[B, Hkv, L, D], and shuffled blocks of --block-size positions named by a table of
bucket / BLK columns (unused columns name scratch block 0). Variants:
  dense   SDPA of q [B, Hkv, G, D] against the slot views [B, Hkv, bucket, D] with an
          additive mask, as forward/fused.py decodes today
  torch   paged_decode_torch: gathers all bucket / BLK blocks per row, SDPA with a mask
  triton  paged_decode_triton: walks each row's live blocks only
  cascade shared_prefix.cascade_decode_triton, with --group > 1: rows in groups of --group
          share their first --prefix positions (whole blocks, below --min-len) as a
          prompt's samples do; each group's shared blocks are read once per step
Per variant: us per call from CUDA events over graph replays (--inner calls per graph,
median of --repeats replays), eager_us the same without the graph, max_abs_diff to dense.
Per case: live_kv_bytes (K and V at the live positions, what the kernel must read) and
bucket_kv_bytes (what the dense and torch paths read), cascade_kv_bytes (what the cascade
must read), so GB/s = bytes / us / 1e3 (given
as live_gbps per variant). Needs CUDA; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from hybridflow.stages.rollout.native.forward import paged_attention as pa
from hybridflow.stages.rollout.native.forward import shared_prefix as sp

SHAPES = {"qwen2-0.5b": (2, 7, 64), "qwen3-0.6b": (8, 2, 128)}  # Hkv, G, D
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def layouts(opts: argparse.Namespace, hkv: int, g: int, d: int) -> dict[str, Any]:
    """One batch in both layouts, on CUDA: the slot cache and the paged cache + table."""
    gen = torch.Generator().manual_seed(opts.seed)
    dtype, b, blk, bucket = DTYPES[opts.dtype], opts.batch, opts.block_size, opts.bucket
    lengths = torch.randint(opts.min_len, opts.max_len + 1, (b,), generator=gen)
    slot_k = torch.randn(b, hkv, bucket, d, generator=gen).to(dtype)
    slot_v = torch.randn(b, hkv, bucket, d, generator=gen).to(dtype)
    used = (lengths + blk - 1) // blk  # blocks per row
    shared = min(opts.prefix, opts.min_len - 1) // blk  # full blocks a group's rows share
    leader = torch.arange(b) // opts.group * opts.group  # [B] each row's group's first row
    if opts.group > 1 and shared:  # the n samples of a prompt: the same prompt K/V
        slot_k[:, :, : shared * blk] = slot_k[leader, :, : shared * blk]
        slot_v[:, :, : shared * blk] = slot_v[leader, :, : shared * blk]
    nb = 1 + int(used.sum())
    ids = torch.randperm(nb - 1, generator=gen) + 1
    table = torch.zeros(b, bucket // blk, dtype=torch.int32)
    cols = torch.arange(bucket // blk)[None, :] < used[:, None]  # [B, MB] allocated entries
    table[cols] = ids.to(torch.int32)
    if opts.group > 1 and shared:  # group rows name the leader's blocks (theirs go unused)
        table[:, :shared] = table[leader, :shared]
    k = torch.zeros(nb, hkv, blk, d, dtype=dtype)
    v = torch.zeros(nb, hkv, blk, d, dtype=dtype)
    # [B, Hkv, MB, BLK, D] -> per allocated (row, column) its [Hkv, BLK, D] block
    k[table[cols].long()] = slot_k.view(b, hkv, -1, blk, d).transpose(1, 2)[cols]
    v[table[cols].long()] = slot_v.view(b, hkv, -1, blk, d).transpose(1, 2)[cols]
    mask = torch.zeros(b, 1, 1, bucket, dtype=dtype)
    mask.masked_fill_(
        torch.arange(bucket)[None, None, None, :] >= lengths[:, None, None, None], float("-inf")
    )
    q = torch.randn(b, hkv, g, d, generator=gen).to(dtype)
    owned = [table[r, : int(used[r])].tolist() for r in range(b)]
    out = dict(q=q, slot_k=slot_k, slot_v=slot_v, mask=mask, k=k, v=v, table=table, lengths=lengths)
    res = {name: t.cuda() for name, t in out.items()}
    cap = sp.members_per_entry(g)
    starts, entries = sp.prefix_groups(owned, None, blk, cap)
    groups = sp.group_tensors(starts, entries, b, cap)
    res.update(zip(("starts", "members", "spans"), (x.cuda() for x in groups), strict=True))
    # positions the cascade reads: each entry's shared ones once, every row's own ones
    cascade = int(lengths.sum()) - sum(starts.values()) + sum(n for _, n in entries)
    res["cascade_positions"], res["grouped_rows"] = cascade, len(starts)
    return res


def events_us(fn: Callable[[], object], inner: int, repeats: int) -> float:
    """Median over `repeats` of the time of one fn() call (each fn() makes `inner` calls)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) * 1e3 / inner)
    return round(statistics.median(times), 2)


def time_variant(call: Callable[[], torch.Tensor], opts: argparse.Namespace) -> tuple[float, float]:
    """(us per call replayed in a CUDA graph of --inner calls, us per call eagerly)."""

    def loop() -> None:
        for _ in range(opts.inner):
            call()

    stream = torch.cuda.Stream()  # warm-up (Triton compiles here) off the capture
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(opts.warmup):
            loop()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loop()
    graphed = events_us(graph.replay, opts.inner, opts.repeats)
    return graphed, events_us(loop, opts.inner, opts.repeats)


def run_case(opts: argparse.Namespace, shape: str) -> dict[str, Any]:
    hkv, g, d = SHAPES[shape]
    t = layouts(opts, hkv, g, d)
    scale, blocks, itemsize = d**-0.5, opts.bucket // opts.block_size, t["q"].element_size()
    variants: dict[str, Callable[[], torch.Tensor]] = {
        "dense": lambda: F.scaled_dot_product_attention(
            t["q"], t["slot_k"], t["slot_v"], attn_mask=t["mask"], scale=scale
        ),
        "torch": lambda: pa.paged_decode_torch(
            t["q"], t["k"], t["v"], t["table"], t["lengths"], scale, blocks
        ),
    }
    why = pa.unsupported(t["q"], t["k"])
    if why is None:
        variants["triton"] = lambda: pa.paged_decode_triton(
            t["q"], t["k"], t["v"], t["table"], t["lengths"], scale, blocks, splits=opts.splits
        )
    groups = (t["starts"], t["members"], t["spans"])
    if why is None and t["grouped_rows"]:
        variants["cascade"] = lambda: sp.cascade_decode_triton(
            t["q"], t["k"], t["v"], t["table"], t["lengths"], scale, blocks, *groups,
            splits=opts.splits, prefix_splits=opts.prefix_splits,
        )  # fmt: skip
    live = int(t["lengths"].sum()) * hkv * d * 2 * itemsize  # K and V
    res: dict[str, Any] = {"hkv": hkv, "g": g, "d": d, "live_kv_bytes": live}
    res["cascade_kv_bytes"] = t["cascade_positions"] * hkv * d * 2 * itemsize
    res["grouped_rows"] = t["grouped_rows"]
    res["bucket_kv_bytes"] = opts.batch * opts.bucket * hkv * d * 2 * itemsize
    res["splits"] = opts.splits or pa.default_splits(opts.batch * hkv, opts.bucket)
    if why is not None:
        res["triton_skipped"] = why
    ref = variants["dense"]().float()
    if opts.sweep and why is None:
        res["sweep"] = sweep(opts, t, scale, blocks, ref)
    if opts.variants:
        variants = {k: f for k, f in variants.items() if k in opts.variants.split(",")}
    for name, call in variants.items():
        us, eager = time_variant(call, opts)
        diff = float((call().float() - ref).abs().max())
        res[name] = {"us": us, "eager_us": eager, "live_gbps": round(live / us / 1e3, 1)}
        res[name]["max_abs_diff"] = diff
    return res


def sweep(
    opts: argparse.Namespace, t: dict[str, Any], scale: float, blocks: int, ref: torch.Tensor
) -> list[dict[str, Any]]:
    """The plain Triton kernel under every launch setting of --sweep's grid -> one entry
    each (us per call in a graph), fastest first."""
    out = []
    for item in opts.sweep.split(";"):
        splits, tile, warps, stages = (int(x) for x in item.split(","))

        def call(s: int = splits, ti: int = tile, w: int = warps, st: int = stages) -> Any:
            return pa.paged_decode_triton(
                t["q"], t["k"], t["v"], t["table"], t["lengths"], scale, blocks,
                splits=s or None, tile=ti, warps=w, stages=st or None,
            )  # fmt: skip

        row: dict[str, Any] = dict(splits=splits, tile=tile, warps=warps, stages=stages)
        try:
            row["us"], _ = time_variant(call, opts)
            row["diff"] = float((call().float() - ref).abs().max())
        except Exception as e:  # e.g. shared memory out of resources: the setting is out
            row["us"], row["error"] = float("inf"), f"{type(e).__name__}: {str(e)[:80]}"
        out.append(row)
    return sorted(out, key=lambda r: r["us"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--bucket", type=int, default=1280, help="the slot path's length bucket")
    ap.add_argument("--min-len", type=int, default=200)
    ap.add_argument("--max-len", type=int, default=1200)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--splits", type=int, default=None, help="kernel splits (default: its own)")
    ap.add_argument("--group", type=int, default=1, help="rows per prompt (GRPO's n)")
    ap.add_argument("--prefix", type=int, default=0, help="positions a prompt's rows share")
    ap.add_argument("--prefix-splits", type=int, default=sp.PREFIX_SPLITS)
    ap.add_argument(
        "--sweep",
        default="",
        help="launch settings of the plain Triton kernel to time, ';'-separated "
        "'splits,tile,warps,stages' (0: the default), e.g. '0,64,4,0;4,64,4,2'",
    )
    ap.add_argument("--variants", default="", help="comma list of variants to time (all)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--inner", type=int, default=10, help="calls per timed graph / loop")
    ap.add_argument("--seed", type=int, default=0)
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/paged_attention.py times CUDA kernels: no CUDA device here")
    if not (1 <= opts.min_len <= opts.max_len <= opts.bucket) or opts.bucket % opts.block_size:
        sys.exit(
            "need 1 <= --min-len <= --max-len <= --bucket, --bucket a multiple of --block-size"
        )
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    out.update(batch=opts.batch, bucket=opts.bucket, block_size=opts.block_size, dtype=opts.dtype)
    out["lengths"] = [opts.min_len, opts.max_len]
    out.update(group=opts.group, prefix=opts.prefix, prefix_splits=opts.prefix_splits)
    with torch.no_grad():
        for shape in opts.shapes.split(","):
            out[shape] = run_case(opts, shape)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

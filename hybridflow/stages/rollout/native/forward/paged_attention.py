"""Decode attention over a paged KV cache (issue 25 item 4).

The slot cache gives every sequence a [Hkv, L, D] slab and decode reads all L positions
of a length bucket; the paged cache gives it blocks of BLK positions named by a table, so
rows share a prompt's blocks and a step reads only what is live. Per layer it consumes
  q        [B, Hkv, G, D]        one decode token, G query heads per KV head (GQA)
  k_cache  [NB, Hkv, BLK, D]     kv[i, 0] (v_cache: kv[i, 1]) of [layers, 2, NB, Hkv, BLK, D]
  table    [S, MB] int32/int64   row b's position p lives in block table[b, p // BLK] at p % BLK
  lengths  [B] int64 (device)    row b attends to positions 0 .. lengths[b] - 1, lengths >= 1
and produces o [B, Hkv, G, D] in q's dtype: softmax(q k^T * scale) v over the live positions.

paged_decode_torch   gathers `blocks` table columns and runs SDPA under a length mask: the
                     CPU path and the reference (reads blocks * BLK positions per row)
paged_decode_triton  one program per (row, KV head[, split]) walking only the row's live
                     positions, block ids read from the table, online softmax in float32
paged_decode         the Triton kernel on CUDA where it applies, else the torch path

Invariants: nothing here syncs with the host or branches on tensor values, and every
shape depends on (B, blocks) alone, so all three run inside the engine's CUDA graphs with
lengths and table rewritten in place between replays. Table entries past a row's live
positions are never used (torch: masked; Triton: never loaded), whatever block they name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybridflow.models.kernels import TRITON, runs_on

if TRITON:  # the GPU path
    import triton
    import triton.language as tl

_DIMS = (64, 128)  # head dims the kernel is tested for
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Positions per kernel iteration (several blocks when BLK < TILE). 128, not 64: measured on
# an H200 (bench/paged_attention.py --sweep, 256 rows, lengths 200-1200, bf16) Qwen2-0.5B's
# call went 42.6 -> 33.1 us (64 rows: 13.8 -> 12.3) and Qwen3-0.6B's stayed ~193 us;
# fewer, longer iterations keep more loads in flight per program.
_TILE = 128
_PROGRAMS = 512  # below this many (row, head) programs, split each row's positions
_MAX_SPLITS = 16
# A shared prefix's partial softmaxes for the decode kernel to merge (shared_prefix.py):
# starts [B] int64, acc [B, Hkv, PRE, G_PAD, D] float32, max and sum [B, Hkv, PRE, G_PAD]
Prefix = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def triton_available() -> bool:
    """True where the Triton kernel can run: triton imports, a CUDA device exists, and
    kernels build there (models/kernels.runs_on)."""
    return torch.cuda.is_available() and runs_on(torch.device("cuda"))


def paged_decode_torch(
    q: torch.Tensor,  # [B, Hkv, G, D]
    k_cache: torch.Tensor,  # [NB, Hkv, BLK, D]
    v_cache: torch.Tensor,  # [NB, Hkv, BLK, D]
    table: torch.Tensor,  # [S >= B, MB >= blocks] int32 or int64
    lengths: torch.Tensor,  # [B] int64, 1 <= lengths <= blocks * BLK
    scale: float,
    blocks: int,
) -> torch.Tensor:
    """Attention of each row's query over its first `blocks` table columns, masked to
    its length -> [B, Hkv, G, D]. Copies B * blocks * BLK positions of K and V."""
    b, hkv, _, d = q.shape
    n = blocks * k_cache.shape[2]
    ids = table[:b, :blocks]  # [B, blocks]
    # [B, blocks, Hkv, BLK, D] -> [B, Hkv, blocks * BLK, D]: position p = column * BLK + offset
    k = k_cache[ids].transpose(1, 2).reshape(b, hkv, n, d)
    v = v_cache[ids].transpose(1, 2).reshape(b, hkv, n, d)
    keep = torch.arange(n, device=q.device)[None, :] < lengths[:b, None]  # [B, n]
    # The G query heads of a KV head are SDPA's query positions, as in the slot path.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :], scale=scale)


def unsupported(q: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """Why the Triton kernel cannot take these tensors (None: it can)."""
    blk, d = k_cache.shape[2], k_cache.shape[3]
    if not triton_available():
        return "triton or CUDA is missing"
    if not (q.is_cuda and k_cache.is_cuda):
        return "tensors are not on a CUDA device"
    if d not in _DIMS or q.shape[3] != d:
        return f"head dim {d} (kernel: {_DIMS})"
    if blk & (blk - 1) or blk > 256:
        return f"block size {blk} is not a power of two <= 256"
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype:
        return f"dtypes q {q.dtype}, cache {k_cache.dtype} (kernel: one of {_DTYPES})"
    if k_cache.stride(3) != 1 or q.stride(3) != 1:
        return "the head dim is not contiguous"
    return None


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    blocks: int,
) -> torch.Tensor:
    """paged_decode_triton where it applies (CUDA, supported D/BLK/dtype), else the torch
    path; same contract as paged_decode_torch -> [B, Hkv, G, D]."""
    if unsupported(q, k_cache) is None:
        return paged_decode_triton(q, k_cache, v_cache, table, lengths, scale, blocks)
    return paged_decode_torch(q, k_cache, v_cache, table, lengths, scale, blocks)


def default_splits(programs: int, positions: int, tile: int = _TILE) -> int:
    """Splits of each row's positions: enough (row, head, split) programs to fill the GPU
    when B * Hkv is small, never more splits than tiles. Shapes only: graph-safe."""
    tiles = max(1, -(-positions // tile))
    return max(1, min(_MAX_SPLITS, _PROGRAMS // programs, tiles))


def paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    blocks: int,
    splits: int | None = None,
    prefix: Prefix | None = None,
    tile: int = _TILE,
    warps: int = 4,
    stages: int | None = None,
) -> torch.Tensor:
    """The Triton kernel; paged_decode_torch's contract, except that it reads only live
    positions, so `blocks` only sizes the split (lengths must still fit the table,
    lengths <= MB * BLK). `splits`: per-row splits (default: default_splits). `prefix`:
    row b reads only positions starts[b].. and merges the partial softmaxes another
    kernel left for its first starts[b] positions (shared_prefix.py). `tile` (positions
    per iteration, a power of two >= 16), `warps`, `stages` (Triton's software
    pipelining; None: its default): launch tuning, for bench/paged_attention.py."""
    why = unsupported(q, k_cache)
    if why is not None:
        raise ValueError(f"paged_decode_triton: {why}")
    b, hkv, g, d = q.shape
    g_pad = max(16, triton.next_power_of_2(g))  # tl.dot wants M >= 16; padded heads masked
    n = splits or default_splits(b * hkv, blocks * k_cache.shape[2], tile)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [B, Hkv, G, D] contiguous
    # Split partials: unnormalised acc [B, Hkv, n, G_PAD, D], running max and sum [.., G_PAD].
    part = torch.empty((b, hkv, n, g_pad, d), dtype=torch.float32, device=q.device) if n > 1 else o
    ml = torch.empty((2, b, hkv, n, g_pad), dtype=torch.float32, device=q.device) if n > 1 else o
    m, l_ = (ml[0], ml[1]) if n > 1 else (o, o)
    # Without a prefix the kernels never touch these pointers (PRE = 0).
    starts, pre, pre_m, pre_l = prefix if prefix is not None else (lengths, o, o, o)
    pre_n = 0 if prefix is None else pre.shape[2]
    _decode_kernel[(b, hkv, n)](
        q, k_cache, v_cache, table, lengths, starts, o, part, m, l_, pre, pre_m, pre_l,
        scale * math.log2(math.e),  # the kernel's exponentials are exp2
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], table.stride(0),
        *o.stride()[:3],
        G=g, G_PAD=g_pad, D=d, BLK=k_cache.shape[2], TILE=tile, SPLITS=n, PRE=pre_n,
        num_warps=warps, **({} if stages is None else {"num_stages": stages}),
    )  # fmt: skip
    if n > 1:
        _combine_kernel[(b, hkv)](
            part, m, l_, o, starts, pre, pre_m, pre_l, *o.stride()[:3], hkv,
            G=g, G_PAD=g_pad, D=d, SPLITS=n, PRE=pre_n,
        )  # fmt: skip
    return o


if TRITON:

    @triton.jit
    def attend_tile(
        q, acc, mx, sm, k_ptr, v_ptr, trow_ptr, pos, length, h,
        sk_n, sk_h, sk_t, sv_n, sv_h, sv_t, scale_log2, ds, BLK: tl.constexpr,
    ):  # fmt: skip
        """One online-softmax step: the query tile q [M, D] against positions `pos`
        [TILE] (those < length; block ids from the table row at trow_ptr) of KV head h
        -> the updated (acc [M, D], max [M], sum [M]), in log2 units."""
        live = pos < length  # the last tile's tail: never loaded
        blk = tl.load(trow_ptr + pos // BLK, live, 0).to(tl.int64)
        off = pos % BLK
        k = tl.load(  # [D, TILE], read transposed for the dot
            k_ptr + blk[None, :] * sk_n + h * sk_h + off[None, :] * sk_t + ds[:, None],
            live[None, :],
            0.0,
        )
        qk = tl.dot(q, k, input_precision="ieee")  # [M, TILE] float32
        qk = tl.where(live[None, :], qk * scale_log2, float("-inf"))
        new = tl.maximum(mx, tl.max(qk, 1))  # finite: every tile has a live position
        alpha = tl.exp2(mx - new)
        p = tl.exp2(qk - new[:, None])
        sm = sm * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + blk[:, None] * sv_n + h * sv_h + off[:, None] * sv_t + ds[None, :],
            live[:, None],
            0.0,
        )  # [TILE, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        return acc, new, sm

    @triton.jit
    def _merge(acc, mx, sm, part_ptr, m_ptr, l_ptr, base, gs, ds, keep, COUNT: tl.constexpr,
               G_PAD: tl.constexpr, D: tl.constexpr):  # fmt: skip
        """Merge COUNT partial softmaxes (contiguous [COUNT, G_PAD(, D)] from `base`) into
        (acc, mx, sm) by rescaling to a common max; rows not `keep` are not loaded (weight
        0, as an empty split's -inf max gives). mx must already be finite."""
        for s in tl.static_range(COUNT):
            row = base + s * G_PAD
            ms = tl.load(m_ptr + row + gs, keep, float("-inf"))
            new = tl.maximum(mx, ms)
            alpha, w = tl.exp2(mx - new), tl.exp2(ms - new)
            sm = sm * alpha + tl.load(l_ptr + row + gs, keep, 0.0) * w
            part = tl.load(part_ptr + (row + gs[:, None]) * D + ds[None, :], keep[:, None], 0.0)
            acc = acc * alpha[:, None] + part * w[:, None]
            mx = new
        return acc, mx, sm

    @triton.jit
    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, start_ptr, o_ptr, part_ptr, m_ptr, l_ptr,
        pre_ptr, pm_ptr, pl_ptr, scale_log2,
        sq_b, sq_h, sq_g, sk_n, sk_h, sk_t, sv_n, sv_h, sv_t, st_b, so_b, so_h, so_g,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLK: tl.constexpr,
        TILE: tl.constexpr, SPLITS: tl.constexpr, PRE: tl.constexpr,
    ):  # fmt: skip
        """Program (row b, KV head h, split s): online softmax over the split's share of
        the row's live tiles of TILE positions, the G query heads as one [G_PAD, D] tile.
        With PRE prefix partials: the row's positions from starts[b] only, and its PRE
        partials merged in when starts[b] > 0 (here, or in _combine_kernel when split)."""
        b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        gs, ds, ts = tl.arange(0, G_PAD), tl.arange(0, D), tl.arange(0, TILE)
        heads = gs[:, None] < G
        q = tl.load(q_ptr + b * sq_b + h * sq_h + gs[:, None] * sq_g + ds[None, :], heads, 0.0)
        length = tl.load(len_ptr + b).to(tl.int32)
        start = 0
        if PRE > 0:
            start = tl.load(start_ptr + b).to(tl.int32)  # < length: the suffix is not empty
        tiles = (length - start + TILE - 1) // TILE  # the loop bound comes from the device
        per = (tiles + SPLITS - 1) // SPLITS
        lo = s * per  # split s: tiles [lo, hi); split 0 always has one (lengths >= 1)
        hi = tl.minimum(lo + per, tiles)
        mx = tl.full([G_PAD], float("-inf"), tl.float32)  # running max (log2 units)
        sm = tl.zeros([G_PAD], tl.float32)  # running sum of exponentials
        acc = tl.zeros([G_PAD, D], tl.float32)
        for i in range(lo, hi):
            acc, mx, sm = attend_tile(
                q, acc, mx, sm, k_ptr, v_ptr, table_ptr + b * st_b, start + i * TILE + ts,
                length, h, sk_n, sk_h, sk_t, sv_n, sv_h, sv_t, scale_log2, ds, BLK,
            )  # fmt: skip
        if SPLITS == 1:
            if PRE > 0:
                acc, mx, sm = _merge(
                    acc, mx, sm, pre_ptr, pm_ptr, pl_ptr, (b * tl.num_programs(1) + h) * PRE * G_PAD,
                    gs, ds, (gs < G) & (start > 0), PRE, G_PAD, D,
                )  # fmt: skip
            out = o_ptr + b * so_b + h * so_h + gs[:, None] * so_g + ds[None, :]
            tl.store(out, (acc / sm[:, None]).to(o_ptr.dtype.element_ty), heads)
        else:  # partials for _combine_kernel, contiguous [B, Hkv, SPLITS, G_PAD(, D)]
            row = ((b * tl.num_programs(1) + h) * SPLITS + s) * G_PAD
            tl.store(part_ptr + (row + gs[:, None]) * D + ds[None, :], acc)
            tl.store(m_ptr + row + gs, mx)
            tl.store(l_ptr + row + gs, sm)

    @triton.jit
    def _combine_kernel(
        part_ptr, m_ptr, l_ptr, o_ptr, start_ptr, pre_ptr, pm_ptr, pl_ptr, so_b, so_h, so_g, H,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
        PRE: tl.constexpr,
    ):  # fmt: skip
        """Program (row b, KV head h): the splits' partial softmaxes (then the row's prefix
        partials, if any) merged. Split 0 is never empty, so the max is finite from the
        first."""
        b, h = tl.program_id(0), tl.program_id(1)
        gs, ds = tl.arange(0, G_PAD), tl.arange(0, D)
        # split 0 alone first: it makes mx finite, which _merge wants
        base = (b * H + h) * SPLITS * G_PAD
        acc = tl.load(part_ptr + (base + gs[:, None]) * D + ds[None, :])
        mx = tl.load(m_ptr + base + gs)
        sm = tl.load(l_ptr + base + gs)
        acc, mx, sm = _merge(
            acc, mx, sm, part_ptr, m_ptr, l_ptr, base + G_PAD, gs, ds, gs >= 0, SPLITS - 1,
            G_PAD, D,
        )  # fmt: skip
        if PRE > 0:
            start = tl.load(start_ptr + b)
            acc, mx, sm = _merge(
                acc, mx, sm, pre_ptr, pm_ptr, pl_ptr, (b * H + h) * PRE * G_PAD, gs, ds,
                (gs < G) & (start > 0), PRE, G_PAD, D,
            )  # fmt: skip
        out = o_ptr + b * so_b + h * so_h + gs[:, None] * so_g + ds[None, :]
        tl.store(out, (acc / sm[:, None]).to(o_ptr.dtype.element_ty), gs[:, None] < G)

"""Shared-prefix (cascade) decode attention over the paged KV cache (issue 25 item 4).

The n samples of a prompt share its full prompt blocks (paged.PagedCache.place), and
plain paged decode reads those blocks once per row. Here a decode step reads them once
per prompt group:

  prefix   per group entry e (up to C member rows) and KV head: the members' C*G query
           heads as one [M, D] tile against the entry's shared positions 0..spans[e]-1,
           read through its first member's table row -> per member row a partial
           softmax (unnormalised acc, max, sum)
  suffix   per row: paged decode over positions starts[b]..lengths[b]-1 (the row's own
           blocks), merged with the row's prefix partials by log-sum-exp

Softmax over two disjoint sets of positions is the log-sum-exp merge of the two parts'
softmaxes, so the result equals plain paged attention up to float rounding; a row in no
group has starts = 0 and gets plain paged decode. Why it pays in RL: GRPO samples n = 8
or more responses per prompt of 100-300 tokens, so a third or more of a step's KV reads
early in a rollout is the same prompt blocks read n times.

Besides paged_decode's arguments (paged_attention.py) it consumes the groups, device
tensors of fixed shapes rewritten in place when block ownership changes (graph-safe, like
the table):
  starts   [S] int64     positions row b's entry covers (0: none); a multiple of BLK below
                         lengths[b]
  members  [S, C] int64  entry e's member rows, -1 padded; member 0's table row names
                         the shared blocks
  spans    [S] int64     entry e's shared positions (0: an unused entry)

prefix_groups          host: who shares what, from block lists and reference counts
group_tensors          ... as the three tensors above
saved_positions        what a step's split saves (the engine's policy: PREFIX_MIN_SAVED)
cascade_decode_torch   gathers and masks (the CPU path and the reference)
cascade_decode_triton  a prefix kernel, then paged_attention's decode kernel with starts
cascade_decode         the Triton path on CUDA where it applies, else the torch path
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

import torch

from hybridflow.models.kernels import TRITON
from hybridflow.stages.rollout.native.forward import paged_attention as pa

MAX_QUERIES = 64  # members * G query heads in one prefix tile (the dot's M)
PREFIX_SPLITS = 2  # programs per (entry, KV head) over the shared positions
PREFIX_TILE = 64  # shared positions per prefix-kernel iteration (its M is up to 64 rows)
# The split pays only when it saves enough: measured on an H200 (bench/RESULTS.md, 256
# rows, bf16, per layer call), with n = 8 rows sharing 256 positions it was slower than
# plain paged decode (Qwen2-0.5B 39.9 -> 46.6 us, Qwen3-0.6B 178.9 -> 209.0), at 512
# even, at 1024 faster (66.7 -> 59.8, 324.9 -> 252.9), at 2048 and n = 16 1.4x and 2x.
# Rows of a group run side by side, so the L2 cache already serves most repeated prompt
# reads of plain decode; what the split saves is the rest, against one more kernel.
# The engine takes the split while the positions it saves per running row, on average,
# are at least this (n = 8 sharing 1024 positions saves 896; n = 8 and 512, 448).
PREFIX_MIN_SAVED = 640


def members_per_entry(query_groups: int) -> int:
    """C: rows per entry so that their query heads fill one tile (0: G is too wide)."""
    return MAX_QUERIES // query_groups


def saved_positions(entries: list[tuple[list[int], int]]) -> int:
    """KV positions per step the split does not read twice: (members - 1) x span each."""
    return sum((len(rows) - 1) * span for rows, span in entries)


def prefix_groups(
    owned: list[list[int]],  # per slot its blocks, in position order
    refs: Sequence[int] | Mapping[int, int] | None,  # block -> slots holding it (None: count)
    block: int,
    cap: int,  # C: most member rows per entry
) -> tuple[dict[int, int], list[tuple[list[int], int]]]:
    """Rows whose leading blocks are the same shared blocks -> (starts: slot -> shared
    positions, entries: (member slots, shared positions)). A group larger than `cap`
    is cut into near-equal entries (a one-row entry is correct, it only saves nothing)."""
    if refs is None:
        refs = Counter(b for blocks in owned for b in blocks)
    by_first: dict[int, list[int]] = {}
    for s, blocks in enumerate(owned):
        if blocks and refs[blocks[0]] > 1:
            by_first.setdefault(blocks[0], []).append(s)
    starts: dict[int, int] = {}
    entries: list[tuple[list[int], int]] = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        lead, shared = owned[rows[0]], len(owned[rows[0]])
        for s in rows[1:]:  # the blocks every member holds at the same place
            other, k = owned[s], 0
            while k < min(shared, len(other)) and other[k] == lead[k]:
                k += 1
            shared = k
        # A row's last block may be the one it writes next; shared blocks are full
        # prompt blocks, never written, so stop where sharing stops.
        while shared and refs[lead[shared - 1]] < 2:
            shared -= 1
        if shared == 0:
            continue
        parts = math.ceil(len(rows) / cap)
        for i in range(parts):
            chunk = rows[i * len(rows) // parts : (i + 1) * len(rows) // parts]
            entries.append((chunk, shared * block))
            starts.update({s: shared * block for s in chunk})
    return starts, entries


def group_tensors(
    starts: dict[int, int], entries: list[tuple[list[int], int]], slots: int, cap: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """prefix_groups' answer as the kernels' host tensors: starts [S], members [S, C]
    (-1 padded), spans [S] (0 past the last entry), all int64."""
    st = torch.zeros(slots, dtype=torch.int64)
    members = torch.full((slots, cap), -1, dtype=torch.int64)
    spans = torch.zeros(slots, dtype=torch.int64)
    for slot, n in starts.items():
        st[slot] = n
    for e, (rows, n) in enumerate(entries):
        members[e, : len(rows)] = torch.tensor(rows, dtype=torch.int64)
        spans[e] = n
    return st, members, spans


def _gather(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Blocks ids [N, nb] of cache [NB, Hkv, BLK, D] -> [N, Hkv, nb * BLK, D]."""
    g = cache[ids]  # [N, nb, Hkv, BLK, D]
    n, nb, h, blk, d = g.shape
    return g.transpose(1, 2).reshape(n, h, nb * blk, d)


def _softmax_part(
    q: torch.Tensor,  # [N, Hkv, M, D]
    k: torch.Tensor,  # [N, Hkv, T, D]
    v: torch.Tensor,  # [N, Hkv, T, D]
    keep: torch.Tensor,  # [N, T] bool
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the kept positions -> (o [N, Hkv, M, D] normalised, lse [N, Hkv,
    M]), in float32 at least; a row that keeps nothing has lse -inf and o 0."""
    ft = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(ft), k.to(ft).transpose(-1, -2)) * scale  # [N, Hkv, M, T]
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)  # [N, Hkv, M]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # all -inf: nan -> 0
    return torch.matmul(p, v.to(ft)), lse


def cascade_decode_torch(
    q: torch.Tensor,  # [B, Hkv, G, D]
    k_cache: torch.Tensor,  # [NB, Hkv, BLK, D]
    v_cache: torch.Tensor,
    table: torch.Tensor,  # [S >= B, MB >= blocks]
    lengths: torch.Tensor,  # [B] int64
    scale: float,
    blocks: int,
    starts: torch.Tensor,  # [S] int64
    members: torch.Tensor,  # [S, C] int64
    spans: torch.Tensor,  # [S] int64
) -> torch.Tensor:
    """The split computed with gathers: every row's suffix over `blocks` columns, every
    entry's prefix over its first member's `blocks` columns (static shapes: B entries,
    unused ones masked), merged -> [B, Hkv, G, D] in q's dtype."""
    b, hkv, g, d = q.shape
    c = members.shape[1]
    pos = torch.arange(blocks * k_cache.shape[2], device=q.device)  # [n]
    ids = table[:b, :blocks]
    keep = (pos[None, :] >= starts[:b, None]) & (pos[None, :] < lengths[:b, None])
    o_s, l_s = _softmax_part(q, _gather(k_cache, ids), _gather(v_cache, ids), keep, scale)
    rows = members[:b]  # [E = B, C]
    safe = rows.clamp(min=0)
    qg = q[safe].permute(0, 2, 1, 3, 4).reshape(b, hkv, c * g, d)  # [E, Hkv, C*G, D]
    lead = table[safe[:, 0], :blocks]
    keep_p = pos[None, :] < spans[:b, None]
    o_p, l_p = _softmax_part(qg, _gather(k_cache, lead), _gather(v_cache, lead), keep_p, scale)
    # Entry outputs back to their rows ([E, Hkv, C, G] -> [E*C, Hkv, G]); padding members
    # write a dropped row b. Rows no entry names keep lse -inf: weight 0 below.
    dest = torch.where(rows >= 0, rows, b).flatten()
    o_rows = o_s.new_zeros(b + 1, hkv, g, d)
    l_rows = l_s.new_full((b + 1, hkv, g), float("-inf"))
    o_rows[dest] = o_p.view(b, hkv, c, g, d).transpose(1, 2).reshape(b * c, hkv, g, d)
    l_rows[dest] = l_p.view(b, hkv, c, g).transpose(1, 2).reshape(b * c, hkv, g)
    o_p, l_p = o_rows[:b], l_rows[:b]
    top = torch.maximum(l_s, l_p)  # finite: every suffix holds the row's own position
    w_s, w_p = torch.exp(l_s - top)[..., None], torch.exp(l_p - top)[..., None]
    return ((o_s * w_s + o_p * w_p) / (w_s + w_p)).to(q.dtype)


def unsupported(q: torch.Tensor, k_cache: torch.Tensor, members: torch.Tensor) -> str | None:
    """Why the Triton path cannot take these tensors (None: it can)."""
    why = pa.unsupported(q, k_cache)
    if why is None and members.shape[1] * q.shape[2] > MAX_QUERIES:
        why = f"{members.shape[1]} members x {q.shape[2]} query heads > {MAX_QUERIES}"
    return why


def cascade_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    blocks: int,
    starts: torch.Tensor,
    members: torch.Tensor,
    spans: torch.Tensor,
) -> torch.Tensor:
    """cascade_decode_triton where it applies, else cascade_decode_torch (same contract)."""
    args = (q, k_cache, v_cache, table, lengths, scale, blocks, starts, members, spans)
    if unsupported(q, k_cache, members) is None:
        return cascade_decode_triton(*args)
    return cascade_decode_torch(*args)


def cascade_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    blocks: int,
    starts: torch.Tensor,
    members: torch.Tensor,
    spans: torch.Tensor,
    splits: int | None = None,
    prefix_splits: int = PREFIX_SPLITS,
) -> torch.Tensor:
    """cascade_decode_torch's contract in two kernels: the prefix kernel (one program per
    entry, KV head and prefix split, reading each shared position once per entry), then
    the paged decode kernel over each row's suffix, which merges the prefix partials."""
    why = unsupported(q, k_cache, members)
    if why is not None:
        raise ValueError(f"cascade_decode_triton: {why}")
    b, hkv, g, d = q.shape
    c = members.shape[1]
    g_pad = max(16, pa.triton.next_power_of_2(g))
    m_pad = max(16, pa.triton.next_power_of_2(c * g))
    ps = prefix_splits
    pre = torch.empty((b, hkv, ps, g_pad, d), dtype=torch.float32, device=q.device)
    ml = torch.empty((2, b, hkv, ps, g_pad), dtype=torch.float32, device=q.device)
    _prefix_kernel[(b, hkv, ps)](
        q, k_cache, v_cache, table, members, spans, pre, ml[0], ml[1],
        scale * math.log2(math.e),
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], table.stride(0),
        members.stride(0),
        G=g, C=c, G_PAD=g_pad, M_PAD=m_pad, D=d, BLK=k_cache.shape[2], TILE=PREFIX_TILE,
        PRE=ps,
    )  # fmt: skip
    prefix = (starts, pre, ml[0], ml[1])
    return pa.paged_decode_triton(
        q, k_cache, v_cache, table, lengths, scale, blocks, splits=splits, prefix=prefix
    )


if TRITON:
    import triton
    import triton.language as tl

    from hybridflow.stages.rollout.native.forward.paged_attention import attend_tile

    @triton.jit
    def _prefix_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, mem_ptr, span_ptr, pre_ptr, pm_ptr, pl_ptr,
        scale_log2,
        sq_b, sq_h, sq_g, sk_n, sk_h, sk_t, sv_n, sv_h, sv_t, st_b, sm_e,
        G: tl.constexpr, C: tl.constexpr, G_PAD: tl.constexpr, M_PAD: tl.constexpr,
        D: tl.constexpr, BLK: tl.constexpr, TILE: tl.constexpr, PRE: tl.constexpr,
    ):  # fmt: skip
        """Program (entry e, KV head h, split s): the members' query heads (tile row
        m = member * G + head) over the split's share of the entry's shared tiles; the
        partials go to each member row's slot s of [B, Hkv, PRE, G_PAD(, D)]. An unused
        entry (span 0, members -1) loads and stores nothing; an empty split stores max
        -inf and zeros, which the merge weighs 0."""
        e, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ms, ds, ts = tl.arange(0, M_PAD), tl.arange(0, D), tl.arange(0, TILE)
        member, head = ms // G, ms % G
        inside = ms < C * G
        rows = tl.load(mem_ptr + e * sm_e + member, inside, -1).to(tl.int64)
        valid = inside & (rows >= 0)
        rows = tl.where(valid, rows, 0)
        q = tl.load(
            q_ptr + rows[:, None] * sq_b + h * sq_h + head[:, None] * sq_g + ds[None, :],
            valid[:, None],
            0.0,
        )  # [M_PAD, D]
        span = tl.load(span_ptr + e).to(tl.int32)
        lead = tl.load(mem_ptr + e * sm_e, span > 0, 0).to(tl.int64)
        tiles = (span + TILE - 1) // TILE
        per = (tiles + PRE - 1) // PRE
        lo = s * per
        hi = tl.minimum(lo + per, tiles)
        mx = tl.full([M_PAD], float("-inf"), tl.float32)
        sm = tl.zeros([M_PAD], tl.float32)
        acc = tl.zeros([M_PAD, D], tl.float32)
        for i in range(lo, hi):
            acc, mx, sm = attend_tile(
                q, acc, mx, sm, k_ptr, v_ptr, table_ptr + lead * st_b, i * TILE + ts, span,
                h, sk_n, sk_h, sk_t, sv_n, sv_h, sv_t, scale_log2, ds, BLK,
            )  # fmt: skip
        at = ((rows * tl.num_programs(1) + h) * PRE + s) * G_PAD + head  # [M_PAD]
        tl.store(pre_ptr + at[:, None] * D + ds[None, :], acc, valid[:, None])
        tl.store(pm_ptr + at, mx, valid)
        tl.store(pl_ptr + at, sm, valid)

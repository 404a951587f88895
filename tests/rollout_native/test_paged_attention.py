"""Decode attention over the paged KV cache (native/forward/paged_attention.py).

Every case starts from a dense slot layout ([B, Hkv, L, D], what the engine decodes
against today) and scatters it into shuffled blocks through a table, rows sharing their
full prefix blocks as a prompt's n samples will. CPU: the torch path equals dense SDPA
on the slot layout, ignores the scratch block and whatever lies past a row's length, and
a wrong table changes the answer. CUDA (marked gpu): the Triton kernel equals the torch
path, split or not, and both replay in a CUDA graph with lengths and table rewritten."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from native_helpers import capture

from hybridflow.stages.rollout.native.forward.paged_attention import (
    paged_decode,
    paged_decode_torch,
    paged_decode_triton,
    unsupported,
)

HKV, BLK, BLOCKS = 2, 16, 8  # rows attend to at most BLOCKS * BLK = 128 positions
# Length 1, exactly one block, one past it, the whole table, and two that share blocks.
LENGTHS = [1, 16, 17, 128, 50, 33]
# row: (row whose first blocks it shares, how many), as far as both rows' lengths allow
SHARED = {2: (1, 1), 4: (3, 2), 5: (3, 2)}
GARBAGE = 1e4  # finite in bf16 too
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class Case(NamedTuple):
    q: torch.Tensor  # [B, Hkv, G, D]
    k: torch.Tensor  # [NB, Hkv, BLK, D]
    v: torch.Tensor  # [NB, Hkv, BLK, D]
    table: torch.Tensor  # [B + 2, BLOCKS + 2]: wider and taller than what is read
    lengths: torch.Tensor  # [B] int64
    dense_k: torch.Tensor  # [B, Hkv, L, D], L > BLOCKS * BLK: the slot layout
    dense_v: torch.Tensor
    scale: float


def make_case(
    g: int,
    d: int,
    dtype: torch.dtype,
    lengths: list[int] = LENGTHS,
    table_dtype: torch.dtype = torch.int32,
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    b, slot = len(lengths), BLOCKS * BLK + 32

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    dense_k, dense_v = randn(b, HKV, slot, d), randn(b, HKV, slot, d)
    blocks = [-(-length // BLK) for length in lengths]  # blocks each row uses
    shared = {}  # SHARED cut to the full blocks of both rows
    for row, (src, n) in SHARED.items():
        if row < b:
            shared[row] = (src, min(n, lengths[row] // BLK, lengths[src] // BLK))
    for row, (src, n) in shared.items():  # shared blocks hold the same positions
        dense_k[row, :, : n * BLK] = dense_k[src, :, : n * BLK]
        dense_v[row, :, : n * BLK] = dense_v[src, :, : n * BLK]
    nb = 1 + b * BLOCKS + 3  # block 0 is the scratch block; shapes depend on B alone
    ids = (torch.randperm(nb - 1, generator=gen) + 1).tolist()
    # Unallocated entries name the scratch block; rows past B are noise, never read.
    table = torch.zeros(b + 2, BLOCKS + 2, dtype=table_dtype)
    table[b:] = torch.randint(0, nb, (2, BLOCKS + 2), generator=gen, dtype=table_dtype)
    for row in range(b):
        src, n = shared.get(row, (row, 0))
        table[row, :n] = table[src, :n]
        for col in range(n, blocks[row]):
            table[row, col] = ids.pop()
    k = torch.full((nb, HKV, BLK, d), GARBAGE, dtype=dtype)
    v = torch.full((nb, HKV, BLK, d), -GARBAGE, dtype=dtype)
    for row, length in enumerate(lengths):
        for col in range(blocks[row]):
            span = slice(col * BLK, (col + 1) * BLK)
            k[table[row, col]] = dense_k[row, :, span]  # [Hkv, BLK, D]
            v[table[row, col]] = dense_v[row, :, span]
        if length % BLK:  # the last block past the length (never shared: not full)
            k[table[row, length // BLK], :, length % BLK :] = GARBAGE
            v[table[row, length // BLK], :, length % BLK :] = -GARBAGE
    lens = torch.tensor(lengths, dtype=torch.int64)
    return Case(randn(b, HKV, g, d), k, v, table, lens, dense_k, dense_v, d**-0.5)


def dense_reference(c: Case) -> torch.Tensor:
    """The engine's slot attention: SDPA over the whole slot with an additive mask."""
    slot = c.dense_k.shape[2]
    mask = torch.zeros(len(c.lengths), 1, 1, slot, dtype=c.q.dtype)
    past = torch.arange(slot)[None, :] >= c.lengths[:, None]  # [B, L]
    mask.masked_fill_(past[:, None, None, :], float("-inf"))
    return F.scaled_dot_product_attention(c.q, c.dense_k, c.dense_v, attn_mask=mask, scale=c.scale)


def run_torch(c: Case, table: torch.Tensor | None = None) -> torch.Tensor:
    t = c.table if table is None else table
    return paged_decode_torch(c.q, c.k, c.v, t, c.lengths, c.scale, BLOCKS)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    return torch.allclose(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", [1, 2, 7])
def test_torch_path_equals_dense_sdpa_on_the_slot_layout(
    g: int, d: int, dtype: torch.dtype
) -> None:
    c = make_case(g, d, dtype)
    out = run_torch(c)
    assert out.shape == c.q.shape and out.dtype == dtype
    assert close(out, dense_reference(c), dtype)


def test_int64_tables_and_the_dispatch_on_cpu_give_the_same_answer() -> None:
    c32 = make_case(7, 64, torch.float32)
    c64 = make_case(7, 64, torch.float32, table_dtype=torch.int64)
    assert torch.equal(c32.table.long(), c64.table)
    assert unsupported(c32.q, c32.k) is not None  # CPU: the torch path
    out = paged_decode(c32.q, c32.k, c32.v, c32.table, c32.lengths, c32.scale, BLOCKS)
    assert torch.equal(out, run_torch(c64))


def test_the_scratch_block_and_the_tails_do_not_reach_the_output() -> None:
    c = make_case(2, 64, torch.bfloat16)
    before = run_torch(c)
    live = torch.zeros(c.k.shape[0], dtype=torch.bool)
    for row, length in enumerate(LENGTHS):
        live[c.table[row, : -(-length // BLK)].long()] = True
    assert not live[0]
    for cache in (c.k, c.v):  # new garbage in every block no live row uses
        cache[~live] = torch.randn(cache[~live].shape).to(cache.dtype) * -3 * GARBAGE
    assert torch.equal(run_torch(c), before)


def test_a_wrong_table_gives_a_different_answer() -> None:
    """The test can fail: row 3 reading another row's block for one of its own changes
    that row alone. (Swapping two of its own blocks would not: attention is order-blind.)"""
    c = make_case(7, 64, torch.float32)
    table = c.table.clone()
    table[3, 2] = table[1, 0]
    right, wrong = run_torch(c), run_torch(c, table)
    assert not close(wrong, dense_reference(c), torch.float32)
    assert (wrong[3] - right[3]).abs().max() > 1e-2
    assert torch.equal(torch.cat([wrong[:3], wrong[4:]]), torch.cat([right[:3], right[4:]]))


# CUDA -----------------------------------------------------------------------------------

LONG = [1, 16, 17, 128, 50, 33, 127, 96, 65, 2, 112, 81]  # more rows: split and unsplit


def cuda_case(g: int, d: int, dtype: torch.dtype, **kw: Any) -> Case:
    c = make_case(g, d, dtype, **kw)
    return c._replace(**{f: getattr(c, f).cuda() for f in c._fields if f != "scale"})


def needs_triton() -> None:
    pytest.importorskip("triton")


def torch_f64(c: Case) -> torch.Tensor:
    """The torch path in float64 (SDPA's math backend): the reference on CUDA, where the
    float32 SDPA kernels may round differently from the CPU's."""
    q, k, v = c.q.double(), c.k.double(), c.v.double()
    return paged_decode_torch(q, k, v, c.table, c.lengths, c.scale, BLOCKS)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", [1, 2, 7])
def test_triton_equals_the_torch_path(
    g: int, d: int, dtype: torch.dtype, splits: int | None
) -> None:
    needs_triton()
    c = cuda_case(g, d, dtype, lengths=LONG)
    assert unsupported(c.q, c.k) is None
    out = paged_decode_triton(c.q, c.k, c.v, c.table, c.lengths, c.scale, BLOCKS, splits=splits)
    assert out.shape == c.q.shape and out.dtype == dtype
    assert close(out, torch_f64(c), dtype)
    assert close(run_torch(c), torch_f64(c), dtype)
    assert close(paged_decode(c.q, c.k, c.v, c.table, c.lengths, c.scale, BLOCKS), out, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_reads_only_live_positions(dtype: torch.dtype) -> None:
    """NaN in every block no live row uses (the scratch block, spares) changes nothing:
    the kernel never loads them (the torch path does, masked, and 0 * NaN is NaN)."""
    needs_triton()
    c = cuda_case(7, 64, dtype, lengths=LONG)
    before = paged_decode_triton(c.q, c.k, c.v, c.table, c.lengths, c.scale, BLOCKS)
    live = torch.zeros(c.k.shape[0], dtype=torch.bool, device="cuda")
    for row, length in enumerate(LONG):
        live[c.table[row, : -(-length // BLK)].long()] = True
    c.k[~live], c.v[~live] = float("nan"), float("nan")
    after = paged_decode_triton(c.q, c.k, c.v, c.table, c.lengths, c.scale, BLOCKS)
    assert torch.equal(after, before)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_graph_replay_follows_lengths_and_table_rewritten_in_place(path: str) -> None:
    if path == "triton":
        needs_triton()
    fn = paged_decode_triton if path == "triton" else paged_decode_torch
    c = cuda_case(7, 64, torch.bfloat16, lengths=LONG)
    new = cuda_case(7, 64, torch.bfloat16, lengths=LONG[::-1], seed=1)
    graph, out = capture(lambda: fn(c.q, c.k, c.v, c.table, c.lengths, c.scale, BLOCKS))
    for x, y in zip(c[:5], new[:5], strict=True):
        x.copy_(y)  # same shapes: another batch's queries, blocks, table and lengths
    graph.replay()
    torch.cuda.synchronize()
    assert close(out, torch_f64(new), torch.bfloat16)
    old = torch_f64(cuda_case(7, 64, torch.bfloat16, lengths=LONG))
    assert not close(out, old, torch.bfloat16)

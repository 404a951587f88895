"""Shared-prefix (cascade) decode attention (native/forward/shared_prefix.py).

Each case lays out rows as the paged cache does for GRPO: prompt groups whose rows share
their full prompt blocks and own the rest, plus rows in no group; block 0 and every
position past a row's length hold garbage. CPU: the groups found from block lists, and
the split (prefix once per group + suffix per row, merged) equals plain paged attention,
which test_paged_attention.py holds equal to dense SDPA; wrong groups change the answer.
CUDA (marked gpu): the Triton kernels equal the torch path, split or not, read no dead
block, and replay in a CUDA graph with the groups rewritten in place."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from native_helpers import capture

from hybridflow.stages.rollout.native.forward.paged_attention import paged_decode_torch
from hybridflow.stages.rollout.native.forward.shared_prefix import (
    cascade_decode,
    cascade_decode_torch,
    cascade_decode_triton,
    group_tensors,
    members_per_entry,
    prefix_groups,
    unsupported,
)

HKV, BLK = 2, 16
GARBAGE = 1e4
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# (rows, shared prompt blocks, per-row positions past them): a GRPO-like n = 8 group, two
# smaller ones, one whose suffix ends inside its first private block, two lone rows
GROUPS = [(8, 3, [1, 5, 16, 17, 40, 2, 33, 64]), (3, 1, [9, 30, 1]), (2, 2, [3, 4])]
LONE = [21, 70]
BLOCKS = 8  # columns read: the longest row's 3 shared + 4 private blocks, and one more


class Case(NamedTuple):
    q: torch.Tensor  # [B, Hkv, G, D]
    k: torch.Tensor  # [NB, Hkv, BLK, D]
    v: torch.Tensor
    table: torch.Tensor  # [B, BLOCKS] int64
    lengths: torch.Tensor  # [B]
    owned: list[list[int]]
    refs: list[int]
    scale: float


def make_case(g: int, d: int, dtype: torch.dtype, seed: int = 0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    owned: list[list[int]] = []
    lengths: list[int] = []
    fresh = iter(range(1, 10_000))  # block 0: scratch
    for rows, shared, tails in GROUPS:
        prompt = [next(fresh) for _ in range(shared)]
        for r in range(rows):
            length = shared * BLK + tails[r]
            own = -(-length // BLK) - shared
            owned.append(prompt + [next(fresh) for _ in range(own)])
            lengths.append(length)
    for length in LONE:
        owned.append([next(fresh) for _ in range(-(-length // BLK))])
        lengths.append(length)
    order = torch.randperm(len(owned), generator=gen).tolist()  # groups' rows interleaved
    owned, lengths = [owned[i] for i in order], [lengths[i] for i in order]
    nb = max(max(o) for o in owned) + 1
    refs = [0] * nb
    for blocks in owned:
        for blk in blocks:
            refs[blk] += 1
    table = torch.zeros(len(owned), BLOCKS, dtype=torch.int64)
    for row, blocks in enumerate(owned):
        table[row, : len(blocks)] = torch.tensor(blocks)
    k = torch.randn(nb, HKV, BLK, d, generator=gen).to(dtype)
    v = torch.randn(nb, HKV, BLK, d, generator=gen).to(dtype)
    k[0], v[0] = GARBAGE, -GARBAGE
    for row, length in enumerate(lengths):  # past each row's length, in its last block
        if length % BLK:
            k[owned[row][-1], :, length % BLK :] = GARBAGE
            v[owned[row][-1], :, length % BLK :] = -GARBAGE
    q = torch.randn(len(owned), HKV, g, d, generator=gen).to(dtype)
    lens = torch.tensor(lengths, dtype=torch.int64)
    return Case(q, k, v, table, lens, owned, refs, d**-0.5)


def groups_of(c: Case, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    starts, entries = prefix_groups(c.owned, c.refs, BLK, cap)
    out = group_tensors(starts, entries, len(c.owned), cap)
    return tuple(t.to(c.q.device) for t in out)  # type: ignore[return-value]


def plain(c: Case) -> torch.Tensor:
    return paged_decode_torch(c.q, c.k, c.v, c.table, c.lengths, c.scale, BLOCKS)


def split(c: Case, groups: tuple[torch.Tensor, ...], fn=cascade_decode_torch, **kw) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return fn(c.q, c.k, c.v, c.table, c.lengths, c.scale, BLOCKS, *groups, **kw)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    return torch.allclose(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_groups_are_the_rows_that_share_leading_blocks() -> None:
    owned = [[1, 2, 3], [1, 2, 4], [5], [1, 2, 6, 7], [8, 9], [8, 10], [11, 12], []]
    refs = [0] * 13
    for blocks in owned:
        for b in blocks:
            refs[b] += 1
    starts, entries = prefix_groups(owned, refs, 16, cap=8)
    assert entries == [([0, 1, 3], 32), ([4, 5], 16)]
    assert starts == {0: 32, 1: 32, 3: 32, 4: 16, 5: 16}
    refs[8] = 1  # row 5 has gone: row 4's block is its own again
    starts, entries = prefix_groups([*owned[:5], [], *owned[6:]], refs, 16, cap=8)
    assert entries == [([0, 1, 3], 32)]


def test_a_group_is_cut_at_the_cap_into_near_equal_entries() -> None:
    owned = [[1, 2 + s] for s in range(9)]
    refs = [0, 9] + [1] * 9
    starts, entries = prefix_groups(owned, refs, 16, cap=4)
    assert [rows for rows, _ in entries] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert set(starts) == set(range(9)) and set(starts.values()) == {16}
    assert members_per_entry(7) == 9 and members_per_entry(2) == 32


def test_groups_stop_where_the_members_blocks_differ() -> None:
    # rows 0 and 1 hold blocks 1, 2 alike; row 2 holds only 1 (a shorter prompt's row)
    owned = [[1, 2, 3], [1, 2, 4], [1, 5]]
    refs = [0, 3, 2, 1, 1, 1]
    starts, entries = prefix_groups(owned, refs, 16, cap=8)
    assert entries == [([0, 1, 2], 16)] and starts == {0: 16, 1: 16, 2: 16}


@pytest.mark.parametrize("cap", [8, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", [1, 2, 7])
def test_the_split_equals_plain_paged_attention(
    g: int, d: int, dtype: torch.dtype, cap: int
) -> None:
    c = make_case(g, d, dtype)
    groups = groups_of(c, cap)
    assert int((groups[0] > 0).sum()) == sum(rows for rows, _, _ in GROUPS)
    out = split(c, groups)
    assert out.shape == c.q.shape and out.dtype == dtype
    assert close(out, plain(c), dtype)
    assert torch.equal(split(c, groups, cascade_decode), out)  # CPU dispatch: the torch path


def test_no_groups_is_plain_attention_and_wrong_groups_are_not() -> None:
    """The test can fail: an entry claiming one block more than its rows share reads the
    first member's private block for the other members, whose outputs change; no row
    outside the entry does."""
    c = make_case(7, 64, torch.float32)
    s = len(c.owned)
    none = (torch.zeros(s, dtype=torch.int64), torch.full((s, 8), -1), torch.zeros(s).long())
    assert close(split(c, none), plain(c), torch.float32)
    starts, members, spans = groups_of(c, 8)
    e = int(members[:, 1].ge(0).nonzero()[0])  # an entry of >= 2 rows
    rows = members[e][members[e] >= 0]
    spans, starts = spans.clone(), starts.clone()
    spans[e] += BLK
    starts[rows] += BLK
    wrong, right = split(c, (starts, members, spans)), plain(c)
    changed = (wrong - right).abs().flatten(1).max(1).values > 1e-3
    assert changed[rows[1:]].all()
    others = torch.ones(s, dtype=torch.bool)
    others[rows] = False
    assert not changed[others].any()


# CUDA -----------------------------------------------------------------------------------


def cuda_case(g: int, d: int, dtype: torch.dtype, seed: int = 0) -> Case:
    c = make_case(g, d, dtype, seed)
    return c._replace(q=c.q.cuda(), k=c.k.cuda(), v=c.v.cuda(), table=c.table.cuda(),
                      lengths=c.lengths.cuda())  # fmt: skip


def needs_triton() -> None:
    pytest.importorskip("triton")


def f64(c: Case) -> Case:
    return c._replace(q=c.q.double(), k=c.k.double(), v=c.v.double())


@pytest.mark.gpu
@pytest.mark.parametrize("prefix_splits", [1, 3])
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", [2, 7])
def test_triton_equals_the_torch_split(
    g: int, d: int, dtype: torch.dtype, splits: int | None, prefix_splits: int
) -> None:
    needs_triton()
    c = cuda_case(g, d, dtype)
    groups = groups_of(c, members_per_entry(g))
    assert unsupported(c.q, c.k, groups[1]) is None
    kw = dict(splits=splits, prefix_splits=prefix_splits)
    out = split(c, groups, cascade_decode_triton, **kw)
    assert out.shape == c.q.shape and out.dtype == dtype
    ref = plain(f64(c))
    assert close(out, ref, dtype)
    assert close(split(c, groups, cascade_decode), ref, dtype)


@pytest.mark.gpu
def test_triton_split_reads_only_live_positions() -> None:
    needs_triton()
    c = cuda_case(7, 64, torch.bfloat16)
    groups = groups_of(c, 9)
    before = split(c, groups, cascade_decode_triton)
    live = torch.zeros(c.k.shape[0], dtype=torch.bool, device="cuda")
    for blocks in c.owned:
        live[blocks] = True
    c.k[~live], c.v[~live] = float("nan"), float("nan")
    assert torch.equal(split(c, groups, cascade_decode_triton), before)


@pytest.mark.gpu
def test_graph_replay_follows_groups_rewritten_in_place() -> None:
    needs_triton()
    c, new = cuda_case(7, 64, torch.bfloat16), cuda_case(7, 64, torch.bfloat16, seed=1)
    groups, new_groups = groups_of(c, 9), groups_of(new, 9)
    graph, out = capture(lambda: split(c, groups, cascade_decode_triton))
    for x, y in zip(
        [c.q, c.k, c.v, c.table, c.lengths, *groups], [*new[:5], *new_groups], strict=True
    ):
        x.copy_(y)
    graph.replay()
    torch.cuda.synchronize()
    assert close(out, plain(f64(new)), torch.bfloat16)

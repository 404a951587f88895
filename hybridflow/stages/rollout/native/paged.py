"""The native engine's paged KV layout (issue 25 item 4, `kv_block_size` > 0).

K/V live in blocks of `block` positions, `kv  # [layers, 2, blocks, Hkv, block, D]`; a slot
owns a list of blocks (its row of the block table `table  # [S, max_blocks]`), so memory
follows the positions a sequence holds instead of reserving max_prompt_len +
max_new_tokens for every slot. Why it matters for RL: responses of 1-4k tokens with a long
tail, where a slot cache is mostly empty reservation. The n samples of one prompt share
its full prompt blocks (written once by the prefill, reference-counted); each row owns
the partially filled last block, so rows never write into a block another row reads.

Slots are cheap here (per-row decode buffers only): there are `max_num_seqs` of them and
the budget buys blocks. Block 0 is a scratch block: table entries past a slot's blocks
point at it, so CUDA-graph padding rows and free slots write only there, and attention
never reads it (every read stops at a row's length).

Ownership is host-side truth (`owned[slot]`, `refs[block]`); the device table is rewritten
from it by `sync()` after every change, before the next forward reads it:
  transfer(moves)    one scheduler move list: content (and its blocks) follows the moves;
                     a destination's old content is overwritten (its blocks freed)
  collect(a, p)      slots neither running (< a) nor parked (>= p) give their blocks back
  place(...)         an admission's blocks: prompts' shared full blocks, per-row tails,
                     a continued session's extra blocks
  grow(slots, need)  blocks for the next decode step's writes; the slots it could not
                     serve are returned (the engine then evicts or preempts)
The scheduler's admission control (`Blocks`) keeps `place` from running short.

Attention: `paged_attention.paged_decode` (a Triton kernel that reads only live blocks on
CUDA, a gather + SDPA elsewhere); prefill and extend write through `address` and read
through `read` (a gather), as on the slot layout. With `prefix_rows` > 0, every change of
sharing (transfer, collect, place; not grow, which adds private blocks) recomputes the
prompt groups at the next `sync` (forward/shared_prefix.prefix_groups, written into the
device tensors starts / members / spans), and the policy decides `cascade`: decode goes
through the shared-prefix split while it saves at least `prefix_min_saved` positions per
slot holding blocks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.errors import ConfigError
from hybridflow.stages.rollout.native.forward.paged_attention import (
    paged_decode,
    triton_available,
)
from hybridflow.stages.rollout.native.forward.shared_prefix import (
    cascade_decode,
    group_tensors,
    members_per_entry,
    prefix_groups,
    saved_positions,
)
from hybridflow.stages.rollout.native.kv_cache import GIB, DecodeMeta, SlotCache, to_device
from hybridflow.stages.rollout.native.scheduler import Blocks

if TYPE_CHECKING:
    from hybridflow.stages.rollout.native.forward.model import NativeModel
    from hybridflow.stages.rollout.native.request import EngineConfig


def make_cache(model: NativeModel, config: EngineConfig, path: str) -> SlotCache:
    """The engine's KV layout for `model` (forward/model.NativeModel) under `config`
    (request.EngineConfig): slots, or paged blocks when kv_block_size > 0, whose prompt
    groups hold as many rows as fill one prefix tile (1 or fewer: no split)."""
    kw: dict[str, Any] = dict(
        layers=len(model.layers),
        kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        max_len=config.max_model_len,
        dtype=model.dtype,
        device=model.device,
        budget_gb=config.kv_cache_gb,
        max_slots=config.max_num_seqs,
        stop_width=config.max_stop_ids,
        path=path,
    )
    if not config.kv_block_size:
        return SlotCache(**kw)
    share = members_per_entry(model.groups) if config.shared_prefix else 0
    return PagedCache(
        block_size=config.kv_block_size,
        prefix_rows=share if share > 1 else 0,
        prefix_min_saved=config.shared_prefix_min_saved,
        **kw,
    )


def block_bytes(layers: int, kv_heads: int, head_dim: int, block: int, itemsize: int) -> int:
    return 2 * layers * kv_heads * block * head_dim * itemsize


class PagedCache(SlotCache):
    def __init__(
        self, *, block_size: int, prefix_rows: int = 0, prefix_min_saved: int = 0, **kw: Any
    ) -> None:
        self.block = block_size
        # > 0: decode may read a prompt's shared blocks once per group of up to this many
        # rows (forward/shared_prefix.py); 0: every row reads its whole history
        self.prefix_rows = prefix_rows
        # ... in the steps where that saves this many positions per row with blocks
        self.prefix_min_saved = prefix_min_saved
        self.cascade = False  # attend through the split (the policy's answer, or forced)
        super().__init__(**kw)
        self.owned: list[list[int]] = [[] for _ in range(self.num_slots)]
        self.refs = [0] * self.num_blocks
        self.free_blocks: list[int] = []
        self.table: torch.Tensor | None = None
        self._dirty: set[int] = set()
        self._regroup = False  # sharing may have changed: recompute the prefix groups
        self.grouped_rows = 0  # rows reading a shared prefix once per group (last sync)
        self.peak_blocks = 0  # most blocks in use at once (memory_stats)
        # The Triton kernel reads each row's live blocks whatever the length bucket.
        self.kernel = self.device.type == "cuda" and triton_available()

    def _size(self, budget_gb: float, max_slots: int, key: str) -> int:
        layers, _, _, kv_heads, length, head_dim = self.shape
        self.block_bytes = block_bytes(layers, kv_heads, head_dim, self.block, self.dtype.itemsize)
        self.max_blocks = math.ceil(length / self.block)  # table columns: one full slot
        self.num_blocks = int(budget_gb * GIB) // self.block_bytes  # block 0: scratch
        if self.num_blocks < self.max_blocks + 1:
            need = (self.max_blocks + 1) * self.block_bytes / GIB
            raise ConfigError(
                key,
                f"{budget_gb} GiB holds {self.num_blocks} KV blocks of {self.block} positions; "
                f"one sequence of {length} positions (prompt + max_new_tokens) needs "
                f"{self.max_blocks} and a scratch block ({need:.3g} GiB); raise kv_cache_gb "
                "or lower max_prompt_len / max_new_tokens",
            )
        return max_slots

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def memory_stats(self) -> dict[str, float]:
        return super().memory_stats() | {
            "kv_blocks": float(self.num_blocks - 1),
            "kv_block_size": float(self.block),
            "kv_blocks_peak": float(self.peak_blocks),
        }

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self.free_blocks)

    def budget(self) -> Blocks:
        """The scheduler's admission budget: the free blocks, less a watermark of 1% of
        the pool (as vLLM's)."""
        return Blocks(len(self.free_blocks), self.block, max(1, self.num_blocks // 100))

    def _make_kv(self) -> torch.Tensor:
        layers, _, _, kv_heads, _, head_dim = self.shape
        shape = (layers, 2, self.num_blocks, kv_heads, self.block, head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def allocate(self) -> None:
        if self.kv is not None:
            return
        super().allocate()
        self.cols = torch.arange(self.max_blocks * self.block, device=self.device)
        self.table = torch.zeros(
            self.num_slots, self.max_blocks, dtype=torch.int64, device=self.device
        )
        self.owned = [[] for _ in range(self.num_slots)]
        self.refs = [0] * self.num_blocks
        self.free_blocks = list(range(self.num_blocks - 1, 0, -1))  # pop() hands out 1 first
        self._dirty.clear()
        i64 = dict(dtype=torch.int64, device=self.device)
        c = max(1, self.prefix_rows)
        self.starts = torch.zeros(self.num_slots, **i64)  # [S] shared positions per row
        self.members = torch.full((self.num_slots, c), -1, **i64)  # [S, C] per entry
        self.spans = torch.zeros(self.num_slots, **i64)  # [S] shared positions per entry
        self._regroup = True

    def release(self) -> None:
        super().release()
        self.table = None
        self.owned = [[] for _ in range(self.num_slots)]
        self.free_blocks = []

    # -- ownership ----------------------------------------------------------------------
    def _drop(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_blocks.append(b)

    def _take(self, count: int) -> list[int] | None:
        if count > len(self.free_blocks):
            return None
        out = [self.free_blocks.pop() for _ in range(count)]
        for b in out:
            self.refs[b] = 1
        self.peak_blocks = max(self.peak_blocks, self.used_blocks)
        return out

    def transfer(self, moves: list[tuple[int, int]]) -> None:
        old = {x: self.owned[x] for pair in moves for x in pair}
        srcs, dsts = {s for s, _ in moves}, {d for _, d in moves}
        for d in dsts - srcs:  # overwritten: nobody holds that content any more
            self._drop(old[d])
        for s, d in moves:
            self.owned[d] = old[s]
        for s in srcs - dsts:
            self.owned[s] = []
        self._dirty |= srcs | dsts
        self._regroup = True

    def collect(self, active: int, parked_from: int) -> None:
        for s in range(active, parked_from):
            if self.owned[s]:
                self._drop(self.owned[s])
                self.owned[s] = []
                self._dirty.add(s)
                self._regroup = True

    def grow(self, slots: list[int], positions: list[int]) -> list[int]:
        """Give each slot blocks for `positions` positions -> the slots left short."""
        short = []
        for s, need in zip(slots, positions, strict=True):
            more = math.ceil(need / self.block) - len(self.owned[s])
            if more > 0:
                got = self._take(more)
                if got is None:
                    short.append(s)
                    continue
                self.owned[s] = self.owned[s] + got
                self._dirty.add(s)
        return short

    def place(self, slots: list[int], group: list[int], lengths: list[int]) -> None:
        """Blocks for an admission's rows (slot slots[r] holds prompt group[r] of
        lengths[.] positions): the first row of a prompt gets all its blocks, the others
        share its full ones and own a tail block; a continued session's slot (already
        holding its parked blocks) grows to its prompt's length."""
        first: dict[int, int] = {}
        for s, u in zip(slots, group, strict=True):
            length = lengths[u]
            if u not in first:
                first[u] = s
                short = self.grow([s], [length])
            else:
                full = self.owned[first[u]][: length // self.block]
                for b in full:
                    self.refs[b] += 1
                self.owned[s] = list(full)
                self._dirty.add(s)
                short = self.grow([s], [length])
            if short:  # the scheduler's Blocks budget promised these: a bug if reached
                raise RuntimeError(f"paged KV: no block left for admitted slot {s}")
        self._regroup = True

    def sync(self) -> None:
        """Rewrite the device table rows of every slot whose blocks changed (and the
        prefix groups, when sharing may have changed: `grow` adds only private blocks)."""
        if self.prefix_rows and self._regroup and self.table is not None:
            self._write_groups()
        if not self._dirty or self.table is None:
            return
        rows = sorted(self._dirty)
        self._dirty.clear()
        host = torch.zeros(len(rows), self.max_blocks, dtype=torch.int64)
        for i, s in enumerate(rows):
            if self.owned[s]:
                host[i, : len(self.owned[s])] = torch.tensor(self.owned[s])
        self.table.index_copy_(0, to_device(rows, self.device), to_device(host, self.device))

    def _write_groups(self) -> None:
        self._regroup = False
        starts, entries = prefix_groups(self.owned, self.refs, self.block, self.prefix_rows)
        host = group_tensors(starts, entries, self.num_slots, self.prefix_rows)
        for dev, value in zip((self.starts, self.members, self.spans), host, strict=True):
            dev.copy_(value, non_blocking=True)  # staged at once from pageable memory
        holders = sum(1 for blocks in self.owned if blocks)
        self.cascade = bool(entries) and (
            saved_positions(entries) >= self.prefix_min_saved * holders
        )
        self.grouped_rows = len(starts) if self.cascade else 0

    # -- what the forward passes use ----------------------------------------------------
    def move(self, src: list[int], dst: list[int], upto: int | None = None) -> None:
        """The per-slot buffers only: K/V stay in their blocks (`transfer` moved the
        ownership), so a move costs no KV copy."""
        s, d = to_device(src, self.device), to_device(dst, self.device)
        n = self.max_len if upto is None else max(1, min(int(upto), self.max_len))
        self._move_rows(s, d, n)

    def address(
        self, slots: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.table is not None
        return self.table[slots, positions // self.block], positions % self.block

    def read(self, i: int, slots: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.kv is not None and self.table is not None
        blocks = self.table[slots, : math.ceil(n / self.block)]  # [U, nb]
        out = []
        for part in (self.kv[i, 0], self.kv[i, 1]):
            g = part[blocks]  # [U, nb, Hkv, block, D]
            u, nb, h, blk, d = g.shape
            out.append(g.permute(0, 2, 1, 3, 4).reshape(u, h, nb * blk, d)[:, :, :n])
        return out[0], out[1]

    def decode_meta(self, positions: torch.Tensor, n: int, dtype: torch.dtype) -> DecodeMeta:
        return DecodeMeta(n, None, positions + 1)

    def attend(self, i: int, q: torch.Tensor, meta: DecodeMeta, scale: float) -> torch.Tensor:
        assert self.kv is not None and self.table is not None
        b, blocks = q.shape[0], math.ceil(meta.n / self.block)
        table, k, v = self.table[:b], self.kv[i, 0], self.kv[i, 1]
        if self.cascade:
            groups = (self.starts[:b], self.members[:b], self.spans[:b])
            return cascade_decode(q, k, v, table, meta.lengths, scale, blocks, *groups)
        return paged_decode(q, k, v, table, meta.lengths, scale, blocks)

    def prompt_writes(
        self, slots: list[int], group: list[int], lengths: list[int], width: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Each prompt's full blocks once (from its first row), every row's tail block;
        no padding position is written."""
        src, blk, off, seen = [], [], [], set()
        for s, u in zip(slots, group, strict=True):
            length = lengths[u]
            start = (length // self.block) * self.block if u in seen else 0
            seen.add(u)
            pos = torch.arange(start, length)
            src.append(u * width + pos)
            blk.append(torch.tensor(self.owned[s], dtype=torch.int64)[pos // self.block])
            off.append(pos % self.block)
        dev = self.device
        return to_device(torch.cat(src), dev), (
            to_device(torch.cat(blk), dev),
            to_device(torch.cat(off), dev),
        )

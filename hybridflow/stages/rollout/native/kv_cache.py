"""The native engine's device memory per sequence slot: the KV cache plus every per-row
decode buffer (next token, position, sampling parameters, seed, outputs so far).

Slot-based, not paged: a slot holds one sequence's K/V for `max_len` positions
(max prompt + max new tokens, rounded up to 16). Why: RL rollouts have a known, modest
bound on sequence length, so the waste of reserving it whole is bounded; in exchange a
decode step reads the first B slots as one dense [B, Hkv, L, D] view that plain torch SDPA
takes directly (no block table, no gather, no custom kernel), and the step's shapes
depend only on B, which is what CUDA graphs need. `max_len` is rounded up to 16 so the
attention mask's last dimension meets the memory-efficient SDPA kernel's alignment.

Budget: slots = min(max_num_seqs, kv_cache_gb // bytes of one slot); a budget too small
for one slot is a ConfigError naming the option. `release` frees everything (the hybrid
engine's sleep); `allocate` makes it again, zeroed.

Invariants: K/V values are always finite (zeros at allocation, real activations after), so
masked positions contribute exactly 0 to attention; `move` copies every per-slot buffer,
so a row's state lives entirely in its slot index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridflow.errors import ConfigError

ALIGN = 16
GIB = float(1 << 30)


@dataclass
class DecodeMeta:
    """Per decode step, shared by every layer's attention."""

    n: int  # positions (length bucket) the dense layouts read
    mask: torch.Tensor | None  # [B, 1, 1, n] additive (0 / -inf), for SDPA
    lengths: torch.Tensor  # [B] int64 positions each row attends to (= its position + 1)


def round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def to_device(values: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    """Host values (an int64 list or a CPU tensor) onto `device` without waiting for the
    work queued there: a plain `.to(device)` from host memory synchronizes the stream
    (PyTorch waits for the copy), which idles the GPU between decode steps. From pageable
    memory the driver stages the bytes before the call returns, so the source may go."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64)
    return t.to(device, non_blocking=True)


def slot_bytes(layers: int, kv_heads: int, head_dim: int, max_len: int, itemsize: int) -> int:
    """K and V of one sequence slot of `max_len` positions (rounded up to ALIGN)."""
    return 2 * layers * kv_heads * round_up(max_len) * head_dim * itemsize


class SlotCache:
    def __init__(
        self,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        budget_gb: float,
        max_slots: int,
        stop_width: int,
        path: str = "",
    ) -> None:
        self.max_len = round_up(max_len)
        self.shape = (layers, 2, 0, kv_heads, self.max_len, head_dim)
        self.dtype, self.device, self.stop_width = dtype, device, stop_width
        self.slot_bytes = slot_bytes(layers, kv_heads, head_dim, max_len, dtype.itemsize)
        self.num_slots = self._size(
            budget_gb, max_slots, f"{path}.kv_cache_gb" if path else "kv_cache_gb"
        )
        self.kv: torch.Tensor | None = None

    def _size(self, budget_gb: float, max_slots: int, key: str) -> int:
        """Slots that fit the budget (whole slots of max_len positions each)."""
        fit = int(budget_gb * GIB) // self.slot_bytes
        if fit < 1:
            raise ConfigError(
                key,
                f"{budget_gb} GiB holds no sequence: one slot of {self.max_len} positions "
                f"(prompt + max_new_tokens) needs {self.slot_bytes / GIB:.3g} GiB; raise "
                "kv_cache_gb or lower max_prompt_len / max_new_tokens",
            )
        return min(max_slots, fit)

    def _make_kv(self) -> torch.Tensor:
        shape = list(self.shape)
        shape[2] = self.num_slots
        return torch.zeros(shape, dtype=self.dtype, device=self.device)  # [layers,2,S,Hkv,L,D]

    @property
    def allocated(self) -> bool:
        return self.kv is not None

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def allocate(self) -> None:
        if self.kv is not None:
            return
        s, L, dev = self.num_slots, self.max_len, self.device
        self.kv = self._make_kv()
        i64 = dict(dtype=torch.int64, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        self.rows = torch.arange(s, **i64)  # [S] static arange for index writes
        self.cols = torch.arange(L, **i64)  # [L] positions (decode masks)
        self.tokens = torch.zeros(s, **i64)  # [S] the token each row feeds next
        self.positions = torch.zeros(s, **i64)  # [S] ... and its position
        self.gen_len = torch.zeros(s, **i64)  # [S] tokens generated so far
        self.max_new = torch.ones(s, **i64)  # [S]
        self.temperature = torch.ones(s, **f32)  # [S] 0 = greedy
        self.top_k = torch.zeros(s, **i64)  # [S] 0 = off
        self.top_p = torch.ones(s, **f32)  # [S] 1 = off
        self.seed_lo = torch.zeros(s, **i64)  # [S] uint32 halves of the request seed
        self.seed_hi = torch.zeros(s, **i64)  # [S]
        self.row = torch.zeros(s, **i64)  # [S] row index within its request
        self.stop = torch.full((s, self.stop_width), -1, **i64)  # [S, W] stop ids, -1 pad
        self.done = torch.zeros(s, dtype=torch.bool, device=dev)  # [S]
        self.out_tok = torch.zeros(s, L, **i64)  # [S, L] generated tokens
        self.out_lp = torch.zeros(s, L, **f32)  # [S, L] their sampling log-probs

    def memory_stats(self) -> dict[str, float]:
        out = {
            "kv_cache_bytes": float(self.nbytes if self.allocated else 0),
            "kv_slots": float(self.num_slots),
            "slot_len": float(self.max_len),
        }
        if self.device.type == "cuda":
            out["peak_allocated_bytes"] = float(torch.cuda.max_memory_allocated(self.device))
            out["peak_reserved_bytes"] = float(torch.cuda.max_memory_reserved(self.device))
        return out

    def release(self) -> None:
        self.kv = None
        for name in self._per_slot:
            setattr(self, name, None)

    _per_slot = (  # every per-slot buffer but the KV cache; "rows", "cols" are constants
        "rows",
        "cols",
        "tokens",
        "positions",
        "gen_len",
        "max_new",
        "temperature",
        "top_k",
        "top_p",
        "seed_lo",
        "seed_hi",
        "row",
        "stop",
        "done",
        "out_tok",
        "out_lp",
    )

    def move(self, src: list[int], dst: list[int], upto: int | None = None) -> None:
        """Copy the rows in slots `src` into slots `dst` (disjoint sets). `upto`: the
        positions (and generated tokens) worth copying, a bound on every moved row's
        valid length (the engine's high-water mark); the rest of a destination slot keeps
        its old, finite, masked values. Parking a session moves its slot twice per turn,
        and copying whole slots cost the multi-turn benchmark 286 ms of device time
        (bench/RESULTS.md)."""
        assert self.kv is not None
        s, d = to_device(src, self.device), to_device(dst, self.device)
        n = self.max_len if upto is None else max(1, min(int(upto), self.max_len))
        kv = self.kv.narrow(4, 0, n)  # [layers, 2, S, Hkv, n, D] view
        kv.index_copy_(2, d, kv.index_select(2, s))
        self._move_rows(s, d, n)

    def _move_rows(self, s: torch.Tensor, d: torch.Tensor, n: int) -> None:
        """The per-slot buffers' part of `move` (`n`: generated tokens worth copying)."""
        for name in self._per_slot[2:]:
            t = getattr(self, name)
            if name in ("out_tok", "out_lp"):  # [S, L]: generated tokens < positions
                t = t.narrow(1, 0, n)
            t.index_copy_(0, d, t.index_select(0, s))

    # -- what the forward passes use (the paged layout overrides these) ----------------
    def transfer(self, moves: list[tuple[int, int]]) -> None:
        """Ownership of storage follows one move list (the paged layout's block lists);
        a slot's K/V here is its own memory, copied by `move`."""

    def collect(self, active: int, parked_from: int) -> None:
        """Free the storage of slots neither running (< active) nor parked (>=
        parked_from); nothing to do when a slot's memory is fixed."""

    def sync(self) -> None:
        """Make the device see the storage changes so far (the paged block table)."""

    def address(
        self, slots: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where position p of slot s lives: kv[layer, 0 or 1][a, :, b] (device tensors)."""
        return slots, positions

    def layer_kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V storage, [A, Hkv, P, D] each: position p of slot s lives at
        [a, :, b] for (a, b) = address(s, p) (a fused kernel writes there itself)."""
        assert self.kv is not None
        return self.kv[i, 0], self.kv[i, 1]

    def write(self, i: int, at: tuple[torch.Tensor, torch.Tensor], k: Any, v: Any) -> None:
        """Layer i's K and V [N, Hkv, D] into the addresses `at` ([N] each)."""
        assert self.kv is not None
        self.kv[i, 0][at[0], :, at[1]] = k
        self.kv[i, 1][at[0], :, at[1]] = v

    def read(self, i: int, slots: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V of `slots` [U] at positions < n -> [U, Hkv, n, D] each."""
        assert self.kv is not None
        return self.kv[i, 0][slots, :, :n], self.kv[i, 1][slots, :, :n]

    def decode_meta(self, positions: torch.Tensor, n: int, dtype: torch.dtype) -> DecodeMeta:
        """Once per decode step: what every layer's attention needs (row b sees
        positions <= positions[b] of the first n)."""
        keep = self.cols[None, :n] <= positions[:, None]  # [B, n]
        mask = torch.zeros(positions.shape[0], 1, 1, n, dtype=dtype, device=self.device)
        mask.masked_fill_(~keep[:, None, None, :], float("-inf"))
        return DecodeMeta(n, mask, positions + 1)

    def attend(self, i: int, q: torch.Tensor, meta: DecodeMeta, scale: float) -> torch.Tensor:
        """Decode attention of rows 0..B-1: q [B, Hkv, G, D] (this step's K/V already
        written) -> [B, Hkv, G, D]."""
        assert self.kv is not None
        b, n = q.shape[0], meta.n
        return F.scaled_dot_product_attention(
            q, self.kv[i, 0, :b, :, :n], self.kv[i, 1, :b, :, :n], attn_mask=meta.mask, scale=scale
        )

    def prompt_writes(
        self,
        slots: list[int],  # [R] the slot of each admitted row
        group: list[int],  # [R] its prompt (0..U-1)
        lengths: list[int],  # [U] prompt lengths
        width: int,  # P: the right-padded prompt batch's width
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """A prefill's cache writes, for every layer: (src [N] rows of the [U*P] flattened
        K/V, their addresses). Here every row writes all P positions of its prompt
        (padding included: later decode writes overwrite it, the mask hides it)."""
        g = torch.tensor(group, dtype=torch.int64)
        pos = torch.arange(width)
        src = (g[:, None] * width + pos[None, :]).flatten()
        a = torch.tensor(slots, dtype=torch.int64)[:, None].expand(-1, width).flatten()
        b = pos[None, :].expand(len(slots), -1).flatten()
        dev = self.device
        return to_device(src, dev), (to_device(a, dev), to_device(b, dev))

    def init_rows(
        self,
        slots: torch.Tensor,  # [R] int64 (device)
        last_pos: torch.Tensor,  # [R] prompt length - 1: `record` steps past the prompt
        params: dict[str, torch.Tensor],  # per-slot buffer name -> [R] (or [R, W]) values
    ) -> None:
        self.positions[slots] = last_pos
        # index_fill_, not `x[slots] = 0`: a Python scalar assigned through an index is
        # first copied to the device from the host, a sync (seen on an H100, session 16)
        self.gen_len.index_fill_(0, slots, 0)
        self.done.index_fill_(0, slots, False)
        for name, value in params.items():
            getattr(self, name)[slots] = to_device(value, self.device)

    def record(self, rows: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor) -> None:
        """Append sampled token `tok` [R] (log-prob `lp` [R]) to `rows` [R], advance them,
        and flag the rows that just finished (stop token or max_new reached). Rows already
        flagged keep their state: the engine's lookahead decodes a row once more before
        the host learns that it finished.

        Clamps keep the writes of padding rows (slots past the live batch in a CUDA-graph
        bucket) inside their own free slot's buffers."""
        g = self.gen_len[rows]
        live = ~self.done[rows]  # a finished row decoded once more (engine lookahead) stays
        at = g.clamp(max=self.max_len - 1)
        self.out_tok[rows, at] = tok  # a finished row's write lands past its end: unread
        self.out_lp[rows, at] = lp
        g = g + live
        self.gen_len[rows] = g
        self.positions[rows] = (self.positions[rows] + live).clamp(max=self.max_len - 1)
        self.tokens[rows] = torch.where(live, tok, self.tokens[rows])
        hit = (self.stop[rows] == tok[:, None]).any(-1)
        self.done[rows] = ~live | hit | (g >= self.max_new[rows])


class Readback:
    """The cache's per-row results back on the host; with `overlap` (CUDA), without
    stalling the device.

    Overlapped, `snapshot` queues a copy of the done flags behind the work queued so far
    and records an event; `take` waits for that event only, so a decode step queued after
    the snapshot keeps the GPU busy while the host waits; `rows` gathers finished rows'
    buffers on a side stream that waits for the same event (never for the step after
    it). Reading those rows while that step runs is safe: `SlotCache.record` leaves a
    finished row's length, position and flags as they were, and its one write lands past
    its end. Otherwise (the CPU, or lockstep) every call is a plain, synchronous read."""

    def __init__(self, device: torch.device, overlap: bool = False) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device) if overlap and device.type == "cuda" else None
        self._flags: torch.Tensor | None = None  # [b] bool, pinned on CUDA
        self._event: Any = None  # recorded behind the flags' copy
        self.after: Any = None  # the last taken snapshot's event (rows read behind it)

    @property
    def pending(self) -> bool:
        return self._flags is not None

    def snapshot(self, done: torch.Tensor) -> None:
        if self.side is None:
            self._flags = done.to("cpu", copy=True)
            return
        self._flags = torch.empty(done.shape, dtype=torch.bool, pin_memory=True)
        self._flags.copy_(done, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def take(self) -> list[int]:
        """The slots flagged done in the pending snapshot ([] with none pending)."""
        flags, self._flags = self._flags, None
        if flags is None:
            return []
        self.after, self._event = self._event, None
        if self.after is not None:
            self.after.synchronize()
        return flags.nonzero().flatten().tolist()

    def clear(self) -> None:
        self._flags = self._event = self.after = None

    def rows(self, slots: list[int], *buffers: torch.Tensor, latest: bool = False) -> list[Any]:
        """`buffers`' rows `slots`, on the host: as of the last taken snapshot, or as of
        everything queued so far (`latest`: a preemption reads rows that keep running)."""
        if self.side is None:
            idx = to_device(slots, self.device)
            return [b[idx].cpu() for b in buffers]
        main = torch.cuda.current_stream(self.device)
        if latest or self.after is None:
            self.side.wait_stream(main)
        else:
            self.side.wait_event(self.after)
        with torch.cuda.stream(self.side):
            idx = to_device(slots, self.device)
            out = []
            for b in buffers:
                host = torch.empty((len(slots), *b.shape[1:]), dtype=b.dtype, pin_memory=True)
                out.append(host.copy_(b[idx], non_blocking=True))
        self.side.synchronize()  # the gathers only: the stream behind them runs on
        return out

"""Continuous-batching bookkeeping of the native engine: which row of which request sits in
which KV-cache slot. Pure Python, no torch, no I/O: the engine asks it what to do and
moves the tensors itself.

Consumes: `add` (a request's rows and prompt lengths), `admit` (free slots -> rows to
prefill now), `finish` (slots whose row stopped). Produces: slot assignments for admitted
rows, the slot moves that keep the running batch dense, the requests that completed, and
`attended(tick)`: how many cache positions a decode step must read, without a device sync.

Invariants (tests replay random finish orders against them):
  - the running rows occupy slots 0 .. active-1, no holes: a decode step reads the first
    `active` slots of every per-slot buffer as plain views (no gather of the KV cache);
    `finish` restores this by moving rows from the top into the holes it left;
  - admission is FIFO over rows (a request submitted earlier starts no later), and one
    admission's prefill work (unique prompts x longest prompt) stays within the budget,
    except that one prompt is always admitted so a long prompt cannot starve;
  - every added row is admitted once and finished once; a request completes exactly when
    its last row finishes;
  - `attended(tick)` >= 1 + the position every running row writes at in the decode step
    numbered `tick` (a row admitted at tick t0 with a prompt of P tokens writes at
    P + tick - t0; a row that stopped early only makes the bound loose, never short).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RowRef:
    """Row `row` (= prompt * n + sample) of request `request_id`."""

    request_id: int
    row: int
    prompt: int


@dataclass
class Admission:
    rows: list[RowRef] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # slots[i] holds rows[i]
    prompts: list[tuple[int, int]] = field(default_factory=list)  # unique (request, prompt)
    group: list[int] = field(default_factory=list)  # rows[i] reads prompts[group[i]]
    width: int = 0  # longest prompt among `prompts`


@dataclass
class Finish:
    rows: list[RowRef] = field(default_factory=list)  # finished, in the order given
    moves: list[tuple[int, int]] = field(default_factory=list)  # (src slot, dst slot)
    completed: list[int] = field(default_factory=list)  # request ids with every row done


class Scheduler:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.slots: list[RowRef] = []  # slots[s] = the row in slot s; len = active rows
        self.offsets: list[int] = []  # offsets[s] = prompt length - admission tick
        self.pending: deque[RowRef] = deque()
        self._prompt_len: dict[tuple[int, int], int] = {}
        self._left: dict[int, int] = {}  # request id -> rows not finished yet

    @property
    def active(self) -> int:
        return len(self.slots)

    @property
    def free(self) -> int:
        return self.num_slots - len(self.slots)

    def has_work(self) -> bool:
        return bool(self.slots or self.pending)

    def requests(self) -> set[int]:
        return set(self._left)

    def add(self, request_id: int, prompt_lens: Sequence[int], n: int) -> None:
        if request_id in self._left:
            raise ValueError(f"request {request_id} was already added")
        if not prompt_lens or n < 1:
            raise ValueError("a request needs >= 1 prompt and n >= 1")
        for p, length in enumerate(prompt_lens):
            self._prompt_len[(request_id, p)] = int(length)
            for j in range(n):
                self.pending.append(RowRef(request_id, p * n + j, p))
        self._left[request_id] = len(prompt_lens) * n

    def admit(self, max_prefill_tokens: int, tick: int = 0) -> Admission:
        """Move pending rows into free slots (FIFO) within the prefill budget; `tick` is
        the number of the decode step that follows this prefill."""
        adm = Admission()
        index: dict[tuple[int, int], int] = {}
        while self.pending and self.free > 0:
            ref = self.pending[0]
            key = (ref.request_id, ref.prompt)
            if key not in index:
                width = max(adm.width, self._prompt_len[key])
                if adm.prompts and (len(adm.prompts) + 1) * width > max_prefill_tokens:
                    break
                index[key] = len(adm.prompts)
                adm.prompts.append(key)
                adm.width = width
            self.pending.popleft()
            adm.rows.append(ref)
            adm.group.append(index[key])
            adm.slots.append(len(self.slots))
            self.slots.append(ref)
            self.offsets.append(self._prompt_len[key] - tick)
        return adm

    def attended(self, tick: int) -> int:
        """Cache positions decode step `tick` reads (0..P+tick-t0 for every row; see the
        invariants); 0 with no running row."""
        return max(self.offsets) + tick + 1 if self.offsets else 0

    def prompt_len(self, request_id: int, prompt: int) -> int:
        return self._prompt_len[(request_id, prompt)]

    def finish(self, slots: Sequence[int]) -> Finish:
        """Retire the rows in `slots`; fill the holes below the new top with rows above it."""
        done = set(slots)
        if len(done) != len(slots) or any(not 0 <= s < self.active for s in done):
            raise ValueError(f"bad finished slots {list(slots)} (active {self.active})")
        out = Finish(rows=[self.slots[s] for s in slots])
        top = self.active - len(done)
        holes = sorted(s for s in done if s < top)
        movers = [s for s in range(top, self.active) if s not in done]
        out.moves = list(zip(movers, holes, strict=True))
        for src, dst in out.moves:
            self.slots[dst] = self.slots[src]
            self.offsets[dst] = self.offsets[src]
        del self.slots[top:]
        del self.offsets[top:]
        for ref in out.rows:
            self._left[ref.request_id] -= 1
            if self._left[ref.request_id] == 0:
                out.completed.append(ref.request_id)
        for rid in out.completed:
            del self._left[rid]
            for key in [k for k in self._prompt_len if k[0] == rid]:
                del self._prompt_len[key]
        return out

    def abort_all(self) -> list[int]:
        """Forget every request (after a failed step); returns their ids."""
        ids = sorted(self._left)
        self.slots.clear()
        self.offsets.clear()
        self.pending.clear()
        self._left.clear()
        self._prompt_len.clear()
        return ids

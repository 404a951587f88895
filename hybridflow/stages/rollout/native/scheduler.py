"""Continuous-batching bookkeeping of the native engine: which row of which request sits in
which KV-cache slot. Pure Python, no torch, no I/O: the engine asks it what to do and
moves the tensors itself.

Consumes: `add` (a request's rows and prompt lengths), `admit` (free slots -> rows to
prefill now), `finish` (slots whose row stopped), `drop` (sessions that ended). Produces:
slot assignments for admitted rows, the slot moves that keep the running batch dense, the
requests that completed, and `attended(tick)`: how many cache positions a decode step must
read, without a device sync.

Sessions (multi-turn): a one-row request may name a `session`. When its row finishes, the
slot is not freed but PARKED with its K/V (`valid` cached positions); the session's next
request is admitted on top of them (`Admission.cached`: positions it need not prefill)
instead of re-prefilling its history. Parked slots fill the top of the slot range
(parked[j] sits in slot num_slots-1-j), running rows the bottom. A row that needs a slot
when none is free evicts the least recently parked session (its next request then
prefills in full). Slot moves are applied with gather-then-scatter semantics (every move
of one list reads the state before any of them writes: SlotCache.move).

Paged KV (`Blocks`): admission also needs the blocks a row's prompt takes (the n rows of a
prompt share its full blocks) and leaves a watermark free, evicting parked
sessions for blocks as for slots; when a decode step's growth finds no block, the engine
`preempt`s rows: they go back to the head of the queue and are admitted again as their
prompt + what they had generated (recomputed; their seeds' streams continue unchanged).

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
    P + tick - t0; a row that stopped early only makes the bound loose, never short);
  - running rows, parked sessions and free slots never overlap: active + parked <= slots;
    a session is running or parked or neither, never both.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

Moves = list[tuple[int, int]]  # (src slot, dst slot), applied all at once


@dataclass(frozen=True)
class RowRef:
    """Row `row` (= prompt * n + sample) of request `request_id`."""

    request_id: int
    row: int
    prompt: int


@dataclass
class Blocks:
    """The paged layout's admission budget (paged.PagedCache): `free` blocks of `size`
    positions. A row is admitted only if its blocks fit and leave `reserve` free (a
    watermark, as vLLM's 1%: rows admitted together grow together, and a row admitted
    only to be preempted at its first step costs a prefill for nothing), or if it is the
    only row."""

    free: int
    size: int
    reserve: int = 1

    def of(self, positions: int) -> int:
        return -(-positions // self.size)


@dataclass
class Admission:
    rows: list[RowRef] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # slots[i] holds rows[i]
    prompts: list[tuple[int, int]] = field(default_factory=list)  # unique (request, prompt)
    group: list[int] = field(default_factory=list)  # rows[i] reads prompts[group[i]]
    width: int = 0  # most positions any of `prompts` prefills (prompt - cached)
    cached: list[int] = field(default_factory=list)  # per prompt: positions already in its slot
    # per prompt: the preempted row whose generated tokens extend it (None: a plain prompt)
    resumed: list[RowRef | None] = field(default_factory=list)
    moves: list[Moves] = field(default_factory=list)  # apply in order, before the prefill
    evicted: list[Hashable] = field(default_factory=list)  # sessions whose K/V is gone


@dataclass
class Finish:
    rows: list[RowRef] = field(default_factory=list)  # finished, in the order given
    moves: Moves = field(default_factory=list)  # survivors into holes, rows into parking
    completed: list[int] = field(default_factory=list)  # request ids with every row done
    parked: list[tuple[Hashable, int]] = field(default_factory=list)  # (session, its slot)


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
        self.parked: list[Hashable] = []  # parked[j] is in slot num_slots - 1 - j
        self._valid: OrderedDict[Hashable, int] = OrderedDict()  # parked, least recent first
        self._session: dict[int, Hashable] = {}  # request id -> its session
        self._running: set[Hashable] = set()  # sessions with a request added, not finished
        self._resume: dict[RowRef, int] = {}  # preempted rows -> tokens they had generated

    @property
    def active(self) -> int:
        return len(self.slots)

    @property
    def free(self) -> int:
        return self.num_slots - len(self.slots) - len(self.parked)

    def slot_of(self, session: Hashable) -> int:
        return self.num_slots - 1 - self.parked.index(session)

    def cached(self, session: Hashable) -> int:
        """Positions of `session`'s K/V held in its parked slot (0: none)."""
        return self._valid.get(session, 0)

    def least_recent(self) -> Hashable:
        """The parked session to evict first (None: none parked)."""
        return next(iter(self._valid), None)

    def has_work(self) -> bool:
        return bool(self.slots or self.pending)

    def requests(self) -> set[int]:
        return set(self._left)

    def add(
        self, request_id: int, prompt_lens: Sequence[int], n: int, session: Hashable = None
    ) -> None:
        if request_id in self._left:
            raise ValueError(f"request {request_id} was already added")
        if not prompt_lens or n < 1:
            raise ValueError("a request needs >= 1 prompt and n >= 1")
        if session is not None:
            if len(prompt_lens) * n != 1:
                raise ValueError("a session's request has exactly one row")
            if session in self._running:
                raise ValueError(f"session {session!r} already has a request in flight")
            self._running.add(session)
            self._session[request_id] = session
        for p, length in enumerate(prompt_lens):
            self._prompt_len[(request_id, p)] = int(length)
            for j in range(n):
                self.pending.append(RowRef(request_id, p * n + j, p))
        self._left[request_id] = len(prompt_lens) * n

    def admit(
        self, max_prefill_tokens: int, tick: int = 0, blocks: Blocks | None = None
    ) -> Admission:
        """Move pending rows into free slots (FIFO) within the prefill budget (and the
        paged layout's `blocks`); `tick` is the number of the decode step that follows
        this prefill. A continued session takes its parked slot's place (no free slot
        needed); any other row evicts the least recently parked session when no slot (or
        block) is free. A preempted row comes back as a prompt of its own: the request's
        prompt and the tokens it had generated."""
        adm = Admission()
        index: dict[tuple[int, ...], int] = {}
        while self.pending:
            ref = self.pending[0]
            extra = self._resume.get(ref, 0)
            key = (ref.request_id, ref.prompt, ref.row) if extra else (ref.request_id, ref.prompt)
            length = self._prompt_len[key[:2]] + extra
            session = self._session.get(ref.request_id)
            cont = session is not None and session in self._valid
            cost = self._cost(blocks, key in index, length, session if cont else None)
            room = blocks is None or blocks.free - cost >= (blocks.reserve if self.slots else 0)
            if (not cont and self.free == 0) or not room:
                victim = next((s for s in self._valid if s != session), None)
                if victim is None:
                    break
                if blocks is not None:
                    blocks.free += blocks.of(self._valid[victim])
                adm.moves.append(self._unpark(victim))
                adm.evicted.append(victim)
                continue
            if key not in index:
                cached = min(self._valid[session], length - 1) if cont else 0
                width = max(adm.width, length - cached)
                if adm.prompts and (len(adm.prompts) + 1) * width > max_prefill_tokens:
                    break
                index[key] = len(adm.prompts)
                adm.prompts.append((ref.request_id, ref.prompt))
                adm.cached.append(cached)
                adm.resumed.append(ref if extra else None)
                adm.width = width
            if blocks is not None:
                blocks.free -= cost
            self.pending.popleft()
            self._resume.pop(ref, None)
            if cont:  # its K/V moves from the parking into the next running slot
                adm.moves.append(self._unpark(session, to=len(self.slots)))
            adm.rows.append(ref)
            adm.group.append(index[key])
            adm.slots.append(len(self.slots))
            self.slots.append(ref)
            self.offsets.append(length - tick)
        return adm

    def _cost(self, blocks: Blocks | None, shared: bool, length: int, parked: Hashable) -> int:
        """Blocks a row's admission takes: all of its prompt's (the first row of a
        prompt), its tail block only (a later row: the full ones are shared), or what a
        continued session adds to the blocks it holds."""
        if blocks is None:
            return 0
        if parked is not None:
            return blocks.of(length) - blocks.of(self._valid[parked])
        if shared:
            return int(length % blocks.size > 0)
        return blocks.of(length)

    def _unpark(self, session: Hashable, to: int | None = None) -> Moves:
        """Take `session` out of the parking (the bottom parked slot fills its place);
        with `to`, its K/V moves to running slot `to` -> the moves (one list)."""
        j = self.parked.index(session)
        slot, bottom = self.num_slots - 1 - j, self.num_slots - len(self.parked)
        moves = [] if to is None or to == slot else [(slot, to)]
        if bottom != slot:
            moves.append((bottom, slot))
            self.parked[j] = self.parked[-1]
        self.parked.pop()
        del self._valid[session]
        return moves

    def drop(self, sessions: Sequence[Hashable]) -> list[Moves]:
        """Forget parked `sessions` (ended trajectories; unknown ones are ignored) ->
        move lists to apply in order."""
        return [self._unpark(s) for s in sessions if s in self._valid]

    def attended(self, tick: int) -> int:
        """Cache positions decode step `tick` reads (0..P+tick-t0 for every row; see the
        invariants); 0 with no running row."""
        return max(self.offsets) + tick + 1 if self.offsets else 0

    def prompt_len(self, request_id: int, prompt: int) -> int:
        return self._prompt_len[(request_id, prompt)]

    def finish(self, slots: Sequence[int], park: Mapping[int, int] | None = None) -> Finish:
        """Retire the rows in `slots`; fill the holes below the new top with rows above it.
        A finished row of a session request whose slot is in `park` ({slot: positions
        of valid K/V}) is parked instead of freed."""
        done = set(slots)
        if len(done) != len(slots) or any(not 0 <= s < self.active for s in done):
            raise ValueError(f"bad finished slots {list(slots)} (active {self.active})")
        park = park or {}
        out = Finish(rows=[self.slots[s] for s in slots])
        parking: Moves = []
        for s in slots:  # park below the parked ones (dsts >= top: no survivor sits there)
            session = self._session.get(self.slots[s].request_id)
            if session is None:
                continue
            self._running.discard(session)
            if s in park:
                dst = self.num_slots - 1 - len(self.parked)
                self.parked.append(session)
                self._valid[session] = int(park[s])
                parking.append((s, dst))
                out.parked.append((session, dst))
        out.moves = self._compact(done) + parking
        for ref in out.rows:
            self._left[ref.request_id] -= 1
            if self._left[ref.request_id] == 0:
                out.completed.append(ref.request_id)
        for rid in out.completed:
            del self._left[rid]
            self._session.pop(rid, None)
            for key in [k for k in self._prompt_len if k[0] == rid]:
                del self._prompt_len[key]
        return out

    def preempt(self, generated: Mapping[int, int]) -> Moves:
        """Put the running rows of `generated`'s slots ({slot: tokens it has generated})
        back at the head of the queue, in FIFO order, to be admitted again as their
        prompt + those tokens (the paged layout ran out of blocks) -> the moves that keep
        the running rows dense. Their requests stay in flight."""
        slots = sorted(generated)
        if any(not 0 <= s < self.active for s in slots) or len(set(slots)) != len(generated):
            raise ValueError(f"bad preempted slots {slots} (active {self.active})")
        refs = [self.slots[s] for s in slots]
        moves = self._compact(set(slots))
        for s, ref in zip(slots, refs, strict=True):
            self._resume[ref] = int(generated[s])
        for ref in sorted(refs, key=lambda r: (r.request_id, r.row), reverse=True):
            self.pending.appendleft(ref)
        return moves

    def _compact(self, removed: set[int]) -> Moves:
        """Take the rows of `removed` slots out of the running batch: rows above the new
        top move down into the holes below it -> those moves (the batch stays dense)."""
        top = self.active - len(removed)
        holes = sorted(s for s in removed if s < top)
        movers = [s for s in range(top, self.active) if s not in removed]
        moves = list(zip(movers, holes, strict=True))
        for src, dst in moves:
            self.slots[dst] = self.slots[src]
            self.offsets[dst] = self.offsets[src]
        del self.slots[top:]
        del self.offsets[top:]
        return moves

    def abort_all(self) -> list[int]:
        """Forget every request and parked session (after a failed step, or before the
        weights change: cached K/V is the old policy's); returns the request ids."""
        ids = sorted(self._left)
        self.slots.clear()
        self.offsets.clear()
        self.pending.clear()
        self._left.clear()
        self._prompt_len.clear()
        self.parked.clear()
        self._valid.clear()
        self._session.clear()
        self._running.clear()
        self._resume.clear()
        return ids

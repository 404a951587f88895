"""The native engine's synchronous core: continuous batching of requests over one model.

    add_request(Request) -> id        queue its rows (validated here)
    step() -> [RequestOutput]         1. one decode step for every running row, attending
                                         to the smallest length bucket that holds every
                                         row's position (a CUDA graph of the smallest batch
                                         and length buckets on GPU, eager on CPU);
                                      2. retire rows that hit a stop token or max_new_tokens,
                                         compact the slots, return every request whose rows
                                         are all done;
                                      3. admit queued rows into free slots and prefill them
                                         (batched; n samples share one prompt prefill; a
                                         session's next turn prefills only its new tokens
                                         on top of its parked K/V), which samples their
                                         first token.

Lookahead (`EngineConfig.lookahead`, opt-in until measured on a GPU): step 2 reads the
done flags of the previous step() (an asynchronous snapshot, kv_cache.Readback) after
step 1 is queued, so the GPU decodes while the host retires and admits; no host-to-device
copy on the way blocks (kv_cache.to_device). A finished row decodes once more, a no-op
(stat `lookahead_rows`).

Sessions (multi-turn, scheduler.py): a finished session row's K/V stays parked in its
slot with the ids it holds; `drop_sessions` frees them when the trajectory ends, and any
weight change, sleep or abort drops them all (cached K/V is the old policy's). A request
whose prompt does not extend its session's cached ids drops the session and prefills in
full: reuse is an optimisation that can never change what is computed.

Not thread-safe: one thread drives it (frontend.AsyncEngine's). Between steps the caller
may `release()` / `allocate()` the cache (sleep / wake) and `refresh_graphs()` after the
weights' storage changed, only while nothing is in flight.

Invariants: a request's rows start in FIFO order and never wait on later requests; at
temperature 0 its tokens are those of running it alone (up to float rounding of batched
kernels); its samples depend on its seed alone (sampler.py); the HF model's parameters are
read, never written.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hybridflow.errors import BatchError
from hybridflow.models.kernels import failure
from hybridflow.stages.rollout.native.forward.model import NativeModel, prompt_logits
from hybridflow.stages.rollout.native.graphs import (
    DecodeGraphs,
    default_buckets,
    default_lengths,
    pick,
)
from hybridflow.stages.rollout.native.kv_cache import Readback, round_up, to_device
from hybridflow.stages.rollout.native.paged import PagedCache, make_cache
from hybridflow.stages.rollout.native.request import (
    EngineConfig,
    Request,
    RequestOutput,
    check_config,
    check_request,
    row_params,
)
from hybridflow.stages.rollout.native.sampling.kernel import StepSampler
from hybridflow.stages.rollout.native.sampling.sampler import row_uniform, sample
from hybridflow.stages.rollout.native.scheduler import Admission, Moves, RowRef, Scheduler

log = logging.getLogger("hybridflow.rollout.native")


@dataclass
class _Live:
    request: Request
    tokens: list[torch.Tensor | None] = field(default_factory=list)  # per row [len]
    logprobs: list[torch.Tensor | None] = field(default_factory=list)
    reused: int = 0  # prompt positions its session's parked K/V held


class NativeEngine:
    def __init__(self, hf_model: Any, config: EngineConfig, *, path: str = "") -> None:
        self.config, self.path = config, path
        check_config(config, path)
        self.model = NativeModel(
            hf_model, round_up(config.max_model_len), autocast_bf16=config.autocast_bf16, path=path
        )
        self.device = self.model.device
        self.fused_off: str | None = "fused_decode: false"  # why decode takes the module path
        compiled = config.compile_decode and self.device.type == "cuda"
        if config.fused_decode:
            self.fused_off = self.model.fuse(compile_fns=compiled, rope_kernel=config.rope_kernel)
            if self.fused_off is not None:
                log.info("%s: decode takes the module path: %s", path or "native", self.fused_off)
        # The per-row uniforms are ~35 integer ops on [B] (4 hash rounds): one kernel
        # compiled, and integer arithmetic is exact either way.
        self._uniform: Any = row_uniform
        if compiled:
            self._uniform = torch.compile(row_uniform, dynamic=True, fullgraph=True)
        self.compile_error: str | None = None  # why a compile_decode fell back to eager
        self.cache = make_cache(self.model, config, path)
        self.paged = self.cache if isinstance(self.cache, PagedCache) else None
        self.num_slots = self.cache.num_slots
        self.scheduler = Scheduler(self.num_slots)
        self.lookahead = config.lookahead
        self.readback = Readback(self.device, overlap=config.lookahead)
        slot_len = self.cache.max_len
        self.lengths = (
            sorted({min(n, slot_len) for n in config.decode_lengths} | {slot_len})
            if config.decode_lengths
            else default_lengths(slot_len)
        )
        if self.paged is not None and self.paged.kernel:
            self.lengths = [slot_len]  # the kernel reads each row's live blocks only
        self.graphs: DecodeGraphs | None = None
        if config.cuda_graphs and self.device.type == "cuda":
            buckets = [b for b in config.graph_batch_sizes if b <= self.num_slots]
            self.graphs = DecodeGraphs(
                sorted({*buckets, self.num_slots}) if buckets else default_buckets(self.num_slots),
                self.lengths,
                self._forward,
                self._sample,
                self.device,
                variants=2 if self.paged is not None and self.paged.prefix_rows else 1,
            )
        self._live: dict[int, _Live] = {}
        # preempted rows (paged KV ran out of blocks) -> the tokens and log-probs they had
        self._resumed: dict[RowRef, tuple[torch.Tensor, torch.Tensor]] = {}
        self.sessions: dict[Hashable, torch.Tensor] = {}  # parked: the ids its K/V holds
        self._ids = itertools.count()
        self._truncating = 0  # live rows that need the top-k/top-p sampling path
        self._tick = 0  # decode steps so far (the scheduler's clock for attended lengths)
        # Cache positions any slot may hold valid K/V at (running rows and parked sessions
        # alike): slot moves copy only these. Back to 0 when no slot holds anything.
        self._high = 0
        self.sampler = StepSampler(config.sample_kernel)  # owns the [S, V] logits buffer
        self.stats = {
            "steps": 0,
            "decode_tokens": 0,
            "prefill_rows": 0,
            "capture_s": 0.0,
            "attended_positions": 0,  # sum over steps of rows x length bucket read
            "prefill_tokens": 0,  # prompt positions computed by prefills
            "reused_tokens": 0,  # prompt positions a session's parked K/V already held
            "session_evictions": 0,  # parked sessions dropped for want of a slot (or block)
            "preemptions": 0,  # rows sent back to the queue for want of a KV block (paged)
            "shared_prefix_rows": 0,  # sum over steps of rows reading a group's prefix once
            "lookahead_rows": 0,  # finished rows decoded once more (see the docstring)
            "busy_s": 0.0,  # seconds inside step() (AsyncEngine counts them)
        }
        self.allocate()

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        return self.cache.allocated

    def allocate(self) -> None:
        """(Re)make the cache and capture the decode graphs. Idempotent."""
        if self.cache.allocated:
            return
        self.cache.allocate()
        m = self.model
        self.sampler.allocate(self.num_slots, m.vocab, m.lm_head, m.autocast, self.device)
        self._probe_compiled()
        self.refresh_graphs()

    @torch.no_grad()
    def _probe_compiled(self) -> None:
        """Run the compiled parts once (no row is live: rows 0..1 write free slots); a
        compile that fails on this machine (no C compiler for Triton, an inductor gap)
        falls back to the eager functions with a warning, not a failed rollout."""
        fused = self.model.fused
        if self._uniform is row_uniform and (fused is None or not fused.compiled):
            return
        b = min(2, self.num_slots)  # 2: dynamo specialises a size of 1
        try:
            self._forward(b, self.lengths[0])
            self._sample(b, False)
        except Exception as e:  # any compiler failure: reported below
            self.compile_error = failure(e)
            log.warning(
                "%s: compile_decode failed, decoding with the eager fused path: %s",
                self.path or "native",
                self.compile_error,
            )
            if fused is not None:
                fused.uncompile()
            self._uniform = row_uniform

    def release(self) -> int:
        """Free the cache and graphs (sleep); returns the bytes the cache held."""
        self._require_idle("release the KV cache")
        held = self.cache.nbytes if self.cache.allocated else 0
        self.drop_all_sessions()
        if self.graphs is not None:
            self.graphs.clear()
        self.cache.release()
        self.sampler.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return held

    @torch.no_grad()
    def refresh_graphs(self) -> None:
        """Re-capture the decode graphs (after parameters got new storage)."""
        if self.graphs is None or not self.cache.allocated:
            return
        self._require_idle("capture CUDA graphs")
        self.stats["capture_s"] += self.graphs.capture()

    def _require_idle(self, what: str) -> None:
        if self._live:
            raise BatchError(
                f"native engine: cannot {what} while {len(self._live)} request(s) are in "
                "flight; the runtime must finish the rollout phase first"
            )

    def in_flight(self) -> int:
        return len(self._live)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def abort_all(self) -> list[int]:
        """Drop every request (after a failed step); returns their ids."""
        ids = self.scheduler.abort_all()
        self.readback.clear()
        self.cache.collect(0, self.num_slots)
        self.cache.sync()
        self._resumed.clear()
        self._high = 0
        self._live.clear()
        self.sessions.clear()
        self._truncating = 0
        return ids

    # -- sessions ------------------------------------------------------------------------
    def drop_sessions(self, sessions: Sequence[Hashable]) -> None:
        """Free the parked K/V of `sessions` (their trajectories ended). Safe between any
        two steps, with requests in flight: it moves parked slots only, never the running
        rows a pending lookahead snapshot names."""
        self._apply(self.scheduler.drop(sessions))
        for key in sessions:
            self.sessions.pop(key, None)

    def drop_all_sessions(self) -> None:
        """Before the weights change or the cache goes: cached K/V is the old policy's."""
        self.drop_sessions(list(self.sessions))

    def _apply(self, moves: list[Moves]) -> None:
        """Apply move lists in order, composed into ONE gather/scatter (a continued turn's
        admission makes one list per session: one copy each would cost a host-to-device
        index copy and ~20 kernels per session)."""
        origin: dict[int, int] = {}  # dst slot -> the slot its content comes from, at first
        for group in moves:
            origin.update({dst: origin.get(src, src) for src, dst in group})
            self.cache.transfer(group)  # paged: block ownership, one list after another
        pairs = [(src, dst) for dst, src in origin.items() if src != dst]
        if pairs:
            src, dst = zip(*pairs, strict=True)
            self.cache.move(list(src), list(dst), upto=self._high)
        sch = self.scheduler
        self.cache.collect(sch.active, sch.num_slots - len(sch.parked))
        self.cache.sync()
        if not (sch.active or sch.parked):
            self._high = 0

    def _check_session(self, request: Request, where: str) -> None:
        """A session's request: one row; its parked K/V is kept only if this prompt
        extends the ids it holds (else it is dropped: a full prefill)."""
        if request.rows != 1:
            raise BatchError(f"{where}: a session's request has one prompt and n = 1")
        held = self.sessions.get(request.session)
        if held is None:
            return
        prompt = request.prompts[0]
        if prompt.numel() <= held.numel() or not torch.equal(prompt[: held.numel()], held):
            self.drop_sessions([request.session])

    def memory_stats(self) -> dict[str, float]:
        return self.cache.memory_stats()

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request: Request) -> int:
        where = "native engine add_request"
        if not self.cache.allocated:
            raise BatchError(f"{where}: the engine is asleep (KV cache released); wake it up")
        check_request(request, self.config, self.model.vocab, where)
        p = request.params
        session = request.session if self.config.keep_sessions else None
        if session is not None:
            self._check_session(request, where)
        if any(x.device.type != "cpu" for x in request.prompts):
            # prompts live on the host: an admission builds its token batch there and
            # copies it once, without waiting; a device prompt would be read back inside
            # step(), a host wait per admission (seen on an H100, session 16)
            request = replace(request, prompts=[x.cpu() for x in request.prompts])
        rid = next(self._ids)
        self._live[rid] = _Live(request, [None] * request.rows, [None] * request.rows)
        self.scheduler.add(rid, [int(x.numel()) for x in request.prompts], p.n, session)
        return rid

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        sch, steps = self.scheduler, self.stats["steps"]
        outputs = self._decode() if sch.active else []
        outputs += self._settle(decoded=self.stats["steps"] > steps)
        if sch.pending and (sch.free or sch.parked):
            self._prefill()
        if sch.active:  # running rows keep their slots until the snapshot is taken
            self.readback.snapshot(self.cache.done[: sch.active])
            if not self.lookahead:
                outputs += self._settle()
        return outputs

    def _settle(self, decoded: bool = False) -> list[RequestOutput]:
        """Retire the rows the pending snapshot flags done (`decoded`: a decode step ran
        since it was taken, which those rows went through once more)."""
        slots = self.readback.take()
        self.stats["lookahead_rows"] += len(slots) if decoded else 0
        return self._retire(slots) if slots else []

    def _decode(self) -> list[RequestOutput]:
        """Queue one decode step of the running rows (-> rows retired to make room)."""
        outputs = self._grow(self.paged) if self.paged is not None else []
        b = self.scheduler.active
        if b == 0:
            return outputs
        truncate = self._truncating > 0
        attended = self.scheduler.attended(self._tick)
        self._high = max(self._high, attended)
        n = pick(self.lengths, attended, "positions")
        split = int(self.paged is not None and self.paged.cascade)  # shared-prefix split
        if self.graphs is not None:
            self.graphs.replay(b, n, truncate, split)
        else:
            self._forward(b, n, split)
            self._sample(b, truncate)
        self._tick += 1
        for key, add in (("attended_positions", b * n), ("steps", 1), ("decode_tokens", b)):
            self.stats[key] += add
        if self.paged is not None:  # rows that read their prompt's blocks once per group
            self.stats["shared_prefix_rows"] += self.paged.grouped_rows
        return outputs

    # -- the step's parts ----------------------------------------------------------------
    def _forward(self, b: int, n: int, split: int = 0) -> None:
        """The decode forward of rows 0..b-1; `split`: 1 reads shared prompt blocks once
        per group (the paged cache's cascade attention), 0 plain (graphs capture both)."""
        c = self.cache
        logits = self.sampler.logits
        assert logits is not None and c.allocated
        paged, policy = self.paged, self.paged is not None and self.paged.cascade
        if paged is not None:
            paged.cascade = bool(split)
        try:
            self.model.decode(c.tokens[:b], c.positions[:b], c.rows[:b], c, n, logits[:b])
        finally:
            if paged is not None:
                paged.cascade = policy

    def _sample(self, b: int, truncate: bool) -> None:
        c = self.cache
        u = self._uniform(c.seed_lo[:b], c.seed_hi[:b], c.row[:b], c.gen_len[:b])
        tok, lp = self.sampler(b, c.temperature[:b], c.top_k[:b], c.top_p[:b], u, truncate)
        c.record(c.rows[:b], tok, lp)

    def _prefill(self) -> None:
        """Admit queued rows and sample their first token (a row that finished on it
        retires from the next snapshot)."""
        paged = self.paged
        blocks = None if paged is None else paged.budget()
        adm = self.scheduler.admit(self.config.max_prefill_tokens, self._tick, blocks)
        self._apply(adm.moves)  # evictions and parked K/V into running slots, in order
        for key in adm.evicted:
            del self.sessions[key]
        self.stats["session_evictions"] += len(adm.evicted)
        if not adm.rows:
            return
        c, dev = self.cache, self.device
        pairs = zip(adm.prompts, adm.resumed, strict=True)
        prompts = [self._prompt(rid, p, ref) for (rid, p), ref in pairs]
        lengths = torch.tensor([x.numel() for x in prompts], dtype=torch.int64)  # [U]
        self._high = max(self._high, int(lengths.max()))
        if paged is not None:
            paged.place(adm.slots, adm.group, lengths.tolist())
            paged.sync()
        slots = to_device(adm.slots, dev)  # [R]
        group = torch.tensor(adm.group, dtype=torch.int64)  # [R]
        c.init_rows(
            slots,
            to_device((lengths - 1)[group], dev),
            row_params(
                [(self._live[r.request_id].request, r.row) for r in adm.rows],
                self.config.max_stop_ids,
            ),
        )
        self._restore(adm)
        logits = prompt_logits(self.model, c, prompts, adm.cached, adm.slots, adm.group, self.stats)
        for (rid, _), cached in zip(adm.prompts, adm.cached, strict=True):
            self._live[rid].reused += cached
        logits = logits[to_device(group, dev)]  # [R, V]
        truncating = sum(self._live[r.request_id].request.params.truncates for r in adm.rows)
        self._truncating += truncating
        u = row_uniform(c.seed_lo[slots], c.seed_hi[slots], c.row[slots], c.gen_len[slots])
        tok, lp = sample(
            logits, c.temperature[slots], c.top_k[slots], c.top_p[slots], u, truncating > 0
        )
        c.record(slots, tok, lp)
        self.stats["prefill_rows"] += len(adm.rows)

    # -- paged KV: growth, preemption and the rows that come back -----------------------
    def _grow(self, paged: PagedCache) -> list[RequestOutput]:
        """Blocks for this decode step's writes (row s writes at offsets[s] + tick). Short
        of blocks: retire the rows a pending snapshot flags done (they free blocks, and a
        preempted one would resume past its end), evict parked sessions (least recent
        first), then preempt running rows from the top slot down (the top rows need no
        move to keep the batch dense) -> the requests the retirement completed."""
        sch, outputs = self.scheduler, []
        need = [off + self._tick + 1 for off in sch.offsets]
        short = paged.grow(list(range(sch.active)), need)
        if short and self.readback.pending:
            outputs = self._settle()
            need = [off + self._tick + 1 for off in sch.offsets]
            short = paged.grow(list(range(sch.active)), need)
        while short:
            victim = sch.least_recent()
            if victim is not None:
                self.drop_sessions([victim])
                self.stats["session_evictions"] += 1
            else:
                self._preempt([sch.active - 1])
            short = [s for s in short if s < sch.active]
            short = paged.grow(short, [need[s] for s in short])
        paged.sync()
        return outputs

    def _preempt(self, slots: list[int]) -> None:
        """Send running rows back to the queue, keeping what they generated: they come
        back as prompt + those tokens (`_prompt`), their seeds' streams continue (the
        uniforms depend on the token index), and the blocks go now."""
        c, sch = self.cache, self.scheduler
        gen, tokens, logprobs = self.readback.rows(
            slots, c.gen_len, c.out_tok, c.out_lp, latest=True
        )
        for i, s in enumerate(slots):
            ref, g = sch.slots[s], int(gen[i])
            self._resumed[ref] = (tokens[i, :g].clone(), logprobs[i, :g].clone())
            self._truncating -= self._live[ref.request_id].request.params.truncates
        self._apply([sch.preempt({s: int(gen[i]) for i, s in enumerate(slots)})])
        self.stats["preemptions"] += len(slots)

    def _prompt(self, rid: int, p: int, resumed: RowRef | None) -> torch.Tensor:
        prompt = self._live[rid].request.prompts[p]
        if resumed is None:
            return prompt
        return torch.cat([prompt, self._resumed[resumed][0].to(prompt.device)])

    def _restore(self, adm: Admission) -> None:
        """A preempted row's generated tokens back into its slot's buffers."""
        c = self.cache
        for slot, g in zip(adm.slots, adm.group, strict=True):
            ref = adm.resumed[g]
            if ref is None:
                continue
            tokens, logprobs = self._resumed.pop(ref)
            n = tokens.numel()
            c.gen_len[slot] = n
            c.out_tok[slot, :n] = to_device(tokens, self.device)
            c.out_lp[slot, :n] = to_device(logprobs, self.device)

    def _retire(self, slots: list[int]) -> list[RequestOutput]:
        c = self.cache
        lengths, tokens, logprobs = self.readback.rows(slots, c.gen_len, c.out_tok, c.out_lp)
        width = int(lengths.max())
        tokens, logprobs = tokens[:, :width].clone(), logprobs[:, :width].clone()  # [k, width]
        park: dict[int, int] = {}
        for i, s in enumerate(slots):  # a session's K/V: the prompt + all but the last token
            ref = self.scheduler.slots[s]
            req = self._live[ref.request_id].request
            if req.session is not None and self.config.keep_sessions:
                held = torch.cat([req.prompts[0], tokens[i, : int(lengths[i]) - 1]])
                self.sessions[req.session] = held
                park[s] = held.numel()
        fin = self.scheduler.finish(slots, park)
        for i, ref in enumerate(fin.rows):
            live = self._live[ref.request_id]
            n = int(lengths[i])
            live.tokens[ref.row] = tokens[i, :n]
            live.logprobs[ref.row] = logprobs[i, :n]
            self._truncating -= live.request.params.truncates
        self._apply([fin.moves])
        if fin.parked:  # graph padding rows write at their slot's position: a scratch one
            at = to_device([s for _, s in fin.parked], self.device)
            c.positions[at] = c.max_len - 1
        done = [self._live.pop(rid) for rid in fin.completed]
        return [
            RequestOutput.of(rid, x.tokens, x.logprobs, x.reused)
            for rid, x in zip(fin.completed, done, strict=True)
        ]

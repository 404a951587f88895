"""The native engine's synchronous core: continuous batching of requests over one model.

    add_request(Request) -> id        queue its rows (validated here)
    step() -> [RequestOutput]         1. admit queued rows into free slots and prefill them
                                         (batched; n samples share one prompt prefill; a
                                         session's next turn prefills only its new tokens
                                         on top of its parked K/V), which samples their
                                         first token;
                                      2. one decode step for every live row, attending to
                                         the smallest length bucket that holds every row's
                                         position (a CUDA graph of the smallest batch and
                                         length buckets on GPU, eager on CPU);
                                      3. retire rows that hit a stop token or max_new_tokens,
                                         compact the slots, return every request whose rows
                                         are all done.

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
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.errors import BatchError, ConfigError
from hybridflow.stages.rollout.native.forward.model import NativeModel, prompt_logits
from hybridflow.stages.rollout.native.graphs import (
    DecodeGraphs,
    default_buckets,
    default_lengths,
    pick,
)
from hybridflow.stages.rollout.native.kv_cache import SlotCache, round_up
from hybridflow.stages.rollout.native.request import Request, RequestOutput
from hybridflow.stages.rollout.native.sampler import row_uniform, sample, split_seed
from hybridflow.stages.rollout.native.scheduler import Moves, Scheduler

log = logging.getLogger("hybridflow.rollout.native")


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int  # prompt + new tokens of one sequence (a slot's length)
    kv_cache_gb: float = 4.0  # budget for the KV cache; slots = budget // slot bytes
    max_num_seqs: int = 256  # most sequences decoded together (slots are capped by this)
    cuda_graphs: bool = True  # capture decode steps on CUDA (ignored on CPU)
    graph_batch_sizes: tuple[int, ...] = ()  # buckets; () = graphs.default_buckets
    # attention lengths decode steps run at; () = graphs.default_lengths (64, 128, ...);
    # one length >= the slot's turns length buckets off (every step reads whole slots)
    decode_lengths: tuple[int, ...] = ()
    # unique prompts x longest prompt per prefill batch (role.py says why 16384)
    max_prefill_tokens: int = 16384
    max_stop_ids: int = 8  # stop ids per request (a static buffer width)
    autocast_bf16: bool = False  # run the float32 model under bf16 autocast
    keep_sessions: bool = True  # park a session's K/V between its requests (False: re-prefill)
    # decode in few kernels: merged q/k/v and gate/up weights, one mask per step (fused.py);
    # a model it cannot take (another activation, LoRA-wrapped projections) keeps the
    # module path
    fused_decode: bool = True
    compile_decode: bool = True  # and its elementwise parts through torch.compile (CUDA)


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
            self.fused_off = self.model.fuse(compile_fns=compiled)
            if self.fused_off is not None:
                log.info("%s: decode takes the module path: %s", path or "native", self.fused_off)
        # The per-row uniforms are ~35 integer ops on [B] (4 hash rounds): one kernel
        # compiled, and integer arithmetic is exact either way.
        self._uniform: Any = row_uniform
        if compiled:
            self._uniform = torch.compile(row_uniform, dynamic=True, fullgraph=True)
        self.compile_error: str | None = None  # why a compile_decode fell back to eager
        self.cache = SlotCache(
            layers=len(self.model.layers),
            kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            max_len=config.max_model_len,
            dtype=self.model.dtype,
            device=self.device,
            budget_gb=config.kv_cache_gb,
            max_slots=config.max_num_seqs,
            stop_width=config.max_stop_ids,
            path=path,
        )
        self.num_slots = self.cache.num_slots
        self.scheduler = Scheduler(self.num_slots)
        slot_len = self.cache.max_len
        self.lengths = (
            sorted({min(n, slot_len) for n in config.decode_lengths} | {slot_len})
            if config.decode_lengths
            else default_lengths(slot_len)
        )
        self.graphs: DecodeGraphs | None = None
        if config.cuda_graphs and self.device.type == "cuda":
            buckets = [b for b in config.graph_batch_sizes if b <= self.num_slots]
            self.graphs = DecodeGraphs(
                sorted({*buckets, self.num_slots}) if buckets else default_buckets(self.num_slots),
                self.lengths,
                self._forward,
                self._sample,
                self.device,
            )
        self._live: dict[int, _Live] = {}
        self.sessions: dict[Hashable, torch.Tensor] = {}  # parked: the ids its K/V holds
        self._ids = itertools.count()
        self._truncating = 0  # live rows that need the top-k/top-p sampling path
        self._tick = 0  # decode steps so far (the scheduler's clock for attended lengths)
        # Cache positions any slot may hold valid K/V at (running rows and parked sessions
        # alike): slot moves copy only these. Back to 0 when no slot holds anything.
        self._high = 0
        self.logits: torch.Tensor | None = None  # [S, V] float32, the decode step's output
        self.stats = {
            "steps": 0,
            "decode_tokens": 0,
            "prefill_rows": 0,
            "capture_s": 0.0,
            "attended_positions": 0,  # sum over steps of rows x length bucket read
            "prefill_tokens": 0,  # prompt positions computed by prefills
            "reused_tokens": 0,  # prompt positions a session's parked K/V already held
            "session_evictions": 0,  # parked sessions dropped for want of a slot
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
        self.logits = torch.zeros(
            self.num_slots, self.model.vocab, dtype=torch.float32, device=self.device
        )
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
            self.compile_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
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
        self.logits = None
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
        self._high = 0
        self._live.clear()
        self.sessions.clear()
        self._truncating = 0
        return ids

    # -- sessions ------------------------------------------------------------------------
    def drop_sessions(self, sessions: Sequence[Hashable]) -> None:
        """Free the parked K/V of `sessions` (their trajectories ended). Safe between any
        two steps, with requests in flight."""
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
        pairs = [(src, dst) for dst, src in origin.items() if src != dst]
        if pairs:
            src, dst = zip(*pairs, strict=True)
            self.cache.move(list(src), list(dst), upto=self._high)
        if not (self.scheduler.active or self.scheduler.parked):
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
        out = {
            "kv_cache_bytes": float(self.cache.nbytes if self.cache.allocated else 0),
            "kv_slots": float(self.num_slots),
            "slot_len": float(self.cache.max_len),
        }
        if self.device.type == "cuda":
            out["peak_allocated_bytes"] = float(torch.cuda.max_memory_allocated(self.device))
            out["peak_reserved_bytes"] = float(torch.cuda.max_memory_reserved(self.device))
        return out

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request: Request) -> int:
        where = "native engine add_request"
        if not self.cache.allocated:
            raise BatchError(f"{where}: the engine is asleep (KV cache released); wake it up")
        p = request.params
        p.check(where)
        if len(p.stop_token_ids) > self.config.max_stop_ids:
            raise BatchError(
                f"{where}: {len(p.stop_token_ids)} stop ids > max_stop_ids "
                f"{self.config.max_stop_ids}"
            )
        if not request.prompts:
            raise BatchError(f"{where}: no prompts")
        caps = request.max_new_tokens
        if caps is not None and (
            len(caps) != request.rows or any(not 1 <= c <= p.max_new_tokens for c in caps)
        ):
            raise BatchError(
                f"{where}: max_new_tokens must hold one cap per row ({request.rows}), each "
                f"in 1..{p.max_new_tokens}"
            )
        limit = self.config.max_model_len - p.max_new_tokens
        for i, ids in enumerate(request.prompts):
            if ids.dim() != 1 or ids.numel() < 1:
                raise BatchError(f"{where}: prompt {i} must be a non-empty 1-D id tensor")
            if ids.numel() > limit:
                raise BatchError(
                    f"{where}: prompt {i} has {ids.numel()} tokens; with max_new_tokens "
                    f"{p.max_new_tokens} a slot of {self.config.max_model_len} positions "
                    f"takes prompts of at most {limit} (raise max_prompt_len)"
                )
            if int(ids.min()) < 0 or int(ids.max()) >= self.model.vocab:
                raise BatchError(f"{where}: prompt {i} has ids outside [0, {self.model.vocab})")
        session = request.session if self.config.keep_sessions else None
        if session is not None:
            self._check_session(request, where)
        rid = next(self._ids)
        self._live[rid] = _Live(request, [None] * request.rows, [None] * request.rows)
        self.scheduler.add(rid, [int(x.numel()) for x in request.prompts], p.n, session)
        return rid

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        if self.scheduler.pending and (self.scheduler.free or self.scheduler.parked):
            outputs += self._prefill()
        b = self.scheduler.active
        if b == 0:
            return outputs
        truncate = self._truncating > 0
        attended = self.scheduler.attended(self._tick)
        self._high = max(self._high, attended)
        n = pick(self.lengths, attended, "positions")
        if self.graphs is not None:
            self.graphs.replay(b, n, truncate)
        else:
            self._forward(b, n)
            self._sample(b, truncate)
        self.stats["attended_positions"] += b * n
        self.stats["steps"] += 1
        self._tick += 1
        self.stats["decode_tokens"] += b
        done = self.cache.done[:b].cpu()  # the one host sync of a step
        if bool(done.any()):
            outputs += self._retire(done.nonzero().flatten().tolist())
        return outputs

    # -- the step's parts ----------------------------------------------------------------
    def _forward(self, b: int, n: int) -> None:
        c = self.cache
        assert self.logits is not None and c.allocated
        self.model.decode(c.tokens[:b], c.positions[:b], c.rows[:b], c, n, self.logits[:b])

    def _sample(self, b: int, truncate: bool) -> None:
        c = self.cache
        assert self.logits is not None
        u = self._uniform(c.seed_lo[:b], c.seed_hi[:b], c.row[:b], c.gen_len[:b])
        tok, lp = sample(self.logits[:b], c.temperature[:b], c.top_k[:b], c.top_p[:b], u, truncate)
        c.record(c.rows[:b], tok, lp)

    def _prefill(self) -> list[RequestOutput]:
        adm = self.scheduler.admit(self.config.max_prefill_tokens, self._tick)
        self._apply(adm.moves)  # evictions and parked K/V into running slots, in order
        for key in adm.evicted:
            del self.sessions[key]
        self.stats["session_evictions"] += len(adm.evicted)
        if not adm.rows:
            return []
        c, dev = self.cache, self.device
        prompts = [self._live[rid].request.prompts[p] for rid, p in adm.prompts]
        lengths = torch.tensor([x.numel() for x in prompts], dtype=torch.int64)  # [U]
        self._high = max(self._high, int(lengths.max()))
        slots = torch.tensor(adm.slots, dtype=torch.int64, device=dev)  # [R]
        group = torch.tensor(adm.group, dtype=torch.int64)  # [R]
        c.init_rows(slots, (lengths - 1)[group].to(dev), self._row_params(adm.rows))
        logits = prompt_logits(self.model, c, prompts, adm.cached, adm.slots, adm.group, self.stats)
        for (rid, _), cached in zip(adm.prompts, adm.cached, strict=True):
            self._live[rid].reused += cached
        logits = logits[group.to(dev)]  # [R, V]
        truncating = sum(self._live[r.request_id].request.params.truncates for r in adm.rows)
        self._truncating += truncating
        u = row_uniform(c.seed_lo[slots], c.seed_hi[slots], c.row[slots], c.gen_len[slots])
        tok, lp = sample(
            logits, c.temperature[slots], c.top_k[slots], c.top_p[slots], u, truncating > 0
        )
        c.record(slots, tok, lp)
        self.stats["prefill_rows"] += len(adm.rows)
        done = c.done[slots].cpu()
        if bool(done.any()):
            return self._retire([adm.slots[i] for i in done.nonzero().flatten().tolist()])
        return []

    def _row_params(self, rows: list[Any]) -> dict[str, torch.Tensor]:
        cols: dict[str, list[Any]] = {k: [] for k in ("max_new", "temperature", "top_k", "top_p")}
        cols.update(seed_lo=[], seed_hi=[], row=[], stop=[])
        w = self.config.max_stop_ids
        for ref in rows:
            req = self._live[ref.request_id].request
            p = req.params
            caps = req.max_new_tokens
            cols["max_new"].append(caps[ref.row] if caps is not None else p.max_new_tokens)
            cols["temperature"].append(p.temperature)
            cols["top_k"].append(p.top_k)
            cols["top_p"].append(p.top_p)
            lo, hi = split_seed(req.seed)
            cols["seed_lo"].append(lo)
            cols["seed_hi"].append(hi)
            cols["row"].append(ref.row)
            cols["stop"].append(list(p.stop_token_ids) + [-1] * (w - len(p.stop_token_ids)))
        out = {k: torch.tensor(v, dtype=torch.int64) for k, v in cols.items()}
        out["temperature"] = torch.tensor(cols["temperature"], dtype=torch.float32)
        out["top_p"] = torch.tensor(cols["top_p"], dtype=torch.float32)
        return out

    def _retire(self, slots: list[int]) -> list[RequestOutput]:
        c = self.cache
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        lengths = c.gen_len[idx].cpu()
        width = int(lengths.max())
        tokens = c.out_tok[idx, :width].cpu()  # [k, width]
        logprobs = c.out_lp[idx, :width].cpu()
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
            at = torch.tensor([s for _, s in fin.parked], dtype=torch.int64, device=self.device)
            c.positions[at] = c.max_len - 1
        return [self._output(rid) for rid in fin.completed]

    def _output(self, rid: int) -> RequestOutput:
        live = self._live.pop(rid)
        toks = [t for t in live.tokens if t is not None]
        lps = [t for t in live.logprobs if t is not None]
        assert len(toks) == len(live.tokens)
        lengths = torch.tensor([t.numel() for t in toks], dtype=torch.int64)  # [R]
        width = int(lengths.max())
        tokens = torch.zeros(len(toks), width, dtype=torch.int64)  # [R, T]
        logprobs = torch.zeros(len(toks), width, dtype=torch.float32)
        for i, (t, lp) in enumerate(zip(toks, lps, strict=True)):
            tokens[i, : t.numel()] = t
            logprobs[i, : lp.numel()] = lp
        return RequestOutput(rid, tokens, logprobs, lengths, live.reused)


def check_config(config: EngineConfig, path: str) -> None:
    """ConfigError naming the option for values the engine cannot run with."""

    def bad(key: str, msg: str) -> ConfigError:
        return ConfigError(f"{path}.{key}" if path else key, msg)

    if config.kv_cache_gb <= 0:
        raise bad("kv_cache_gb", f"must be > 0, got {config.kv_cache_gb}")
    if config.max_num_seqs < 1:
        raise bad("max_num_seqs", f"must be >= 1, got {config.max_num_seqs}")
    if any(b < 1 for b in config.graph_batch_sizes):
        raise bad("graph_batch_sizes", f"must be >= 1, got {list(config.graph_batch_sizes)}")
    if any(n < 1 for n in config.decode_lengths):
        raise bad("decode_lengths", f"must be >= 1, got {list(config.decode_lengths)}")
    if config.max_prefill_tokens < 1:
        raise bad("max_prefill_tokens", f"must be >= 1, got {config.max_prefill_tokens}")

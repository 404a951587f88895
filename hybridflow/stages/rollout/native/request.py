"""What goes into and comes out of the native engine: one request = one micro-batch.

  Request        prompts: list of [P_i] int64 token ids (no padding), each sampled n times
                 (row i*n+j = sample j of prompt i); SamplingParams; a seed; optionally a
                 `session` (one prompt, n = 1): the engine keeps the row's K/V after it
                 ends, and the session's next request, whose prompt extends this one's
                 prompt + output, prefills only what is new (multi-turn turns)
  EngineConfig   the engine's own settings (the role builds it from its options)
  RequestOutput  tokens [R, T] int64 (0 after each row's end), logprobs [R, T] float32 (0
                 there), lengths [R] int64, R = len(prompts) * n, T = longest row

Invariant: a request's samples are a function of its prompts, params, seed and the weights
alone (sampler.py says how), never of what else the engine runs at the same time.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.errors import BatchError, ConfigError
from hybridflow.stages.rollout.native.forward.shared_prefix import PREFIX_MIN_SAVED
from hybridflow.stages.rollout.native.sampling.sampler import split_seed


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (reports temperature-1 log-probs)
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()  # empty: run to max_new_tokens (ignore EOS)

    @property
    def truncates(self) -> bool:
        """Whether sampling needs the sorted top-k/top-p path."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1)

    def check(self, where: str) -> None:
        if self.temperature < 0:
            raise BatchError(f"{where}: temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise BatchError(f"{where}: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise BatchError(f"{where}: top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1 or self.n < 1:
            raise BatchError(f"{where}: max_new_tokens and n must be >= 1")


@dataclass
class Request:
    prompts: list[torch.Tensor]  # each [P_i] int64, P_i >= 1
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    session: Hashable = None  # keep this row's K/V for the session's next request
    # per-row caps (len == rows, each in 1..params.max_new_tokens); None: params' cap for all
    max_new_tokens: list[int] | None = None

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.params.n


@dataclass
class RequestOutput:
    request_id: int
    tokens: torch.Tensor  # [R, T] int64
    logprobs: torch.Tensor  # [R, T] float32
    lengths: torch.Tensor  # [R] int64
    reused_tokens: int = 0  # prompt positions taken from the session's parked K/V

    @classmethod
    def of(
        cls,
        rid: int,
        tokens: Sequence[torch.Tensor | None],  # per row [len_r]: every row done
        logprobs: Sequence[torch.Tensor | None],
        reused: int,
    ) -> RequestOutput:
        """The rows' tokens and log-probs right-padded with 0 into [R, T]."""
        toks = [t for t in tokens if t is not None]
        lps = [t for t in logprobs if t is not None]
        assert len(toks) == len(tokens) == len(lps)
        lengths = torch.tensor([t.numel() for t in toks], dtype=torch.int64)  # [R]
        width = int(lengths.max())
        out_tok = torch.zeros(len(toks), width, dtype=torch.int64)  # [R, T]
        out_lp = torch.zeros(len(toks), width, dtype=torch.float32)
        for i, (t, lp) in enumerate(zip(toks, lps, strict=True)):
            out_tok[i, : t.numel()] = t
            out_lp[i, : lp.numel()] = lp
        return cls(rid, out_tok, out_lp, lengths, reused)


def row_params(rows: Sequence[tuple[Request, int]], stop_width: int) -> dict[str, torch.Tensor]:
    """The per-slot sampling buffers' values (kv_cache.SlotCache.init_rows) of admitted
    rows, each given as (its request, its row index in the request)."""
    cols: dict[str, list[Any]] = {k: [] for k in ("max_new", "temperature", "top_k", "top_p")}
    cols.update(seed_lo=[], seed_hi=[], row=[], stop=[])
    for req, row in rows:
        p = req.params
        caps = req.max_new_tokens
        cols["max_new"].append(caps[row] if caps is not None else p.max_new_tokens)
        cols["temperature"].append(p.temperature)
        cols["top_k"].append(p.top_k)
        cols["top_p"].append(p.top_p)
        lo, hi = split_seed(req.seed)
        cols["seed_lo"].append(lo)
        cols["seed_hi"].append(hi)
        cols["row"].append(row)
        cols["stop"].append(list(p.stop_token_ids) + [-1] * (stop_width - len(p.stop_token_ids)))
    out = {k: torch.tensor(v, dtype=torch.int64) for k, v in cols.items()}
    out["temperature"] = torch.tensor(cols["temperature"], dtype=torch.float32)
    out["top_p"] = torch.tensor(cols["top_p"], dtype=torch.float32)
    return out


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
    # 0: slot KV (each sequence reserves max_model_len positions); > 0: paged KV in blocks
    # of this many positions (paged.py), a multiple of 16
    kv_block_size: int = 0
    # paged KV: a prompt's n rows read its shared blocks once per decode step (cascade
    # attention, forward/shared_prefix.py) while that saves at least
    # `shared_prefix_min_saved` positions of KV reads per running row on average;
    # False: each row always reads its whole history
    shared_prefix: bool = True
    shared_prefix_min_saved: int = PREFIX_MIN_SAVED
    # decode in few kernels: merged q/k/v and gate/up weights, one mask per step (fused.py);
    # a model it cannot take (another activation, LoRA-wrapped projections) keeps the
    # module path
    fused_decode: bool = True
    compile_decode: bool = True  # and its elementwise parts through torch.compile (CUDA)
    # read a step's finished rows after queueing the next step (engine.py "Lookahead"; it
    # overlaps only on CUDA: on the CPU the host is the device). The role turns it on for
    # GPUs (its decode_lookahead option; bench/RESULTS.md "Session 16")
    lookahead: bool = False
    # Triton kernels in the decode step (CUDA; the torch paths stay the reference): one
    # per layer for the q/k/v split, norms, RoPE and K/V writes (forward/rope_write.py),
    # and two for an untruncated sampling step (sampling/kernel.py), which then reads the
    # head's bfloat16 logits without a float32 copy. Where they cannot run (the CPU, no
    # triton, mixed dtypes) the torch paths do. On an H100 (bench/RESULTS.md, session 16):
    # Qwen2-0.5B, 152k vocabulary, 256 rows, 94.4k -> 141.4k decode tok/s
    rope_kernel: bool = True
    sample_kernel: bool = True


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
    if config.shared_prefix_min_saved < 0:
        raise bad(
            "shared_prefix_min_saved",
            f"must be >= 0 (0: always), got {config.shared_prefix_min_saved}",
        )
    if config.kv_block_size < 0 or config.kv_block_size % 16:
        raise bad(
            "kv_block_size",
            f"must be 0 (slot KV) or a positive multiple of 16, got {config.kv_block_size}",
        )


def check_request(request: Request, config: EngineConfig, vocab: int, where: str) -> None:
    """BatchError for a request the engine cannot run (its params, stop ids, caps, prompt
    lengths and ids)."""
    p = request.params
    p.check(where)
    if len(p.stop_token_ids) > config.max_stop_ids:
        raise BatchError(
            f"{where}: {len(p.stop_token_ids)} stop ids > max_stop_ids {config.max_stop_ids}"
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
    limit = config.max_model_len - p.max_new_tokens
    for i, ids in enumerate(request.prompts):
        if ids.dim() != 1 or ids.numel() < 1:
            raise BatchError(f"{where}: prompt {i} must be a non-empty 1-D id tensor")
        if ids.numel() > limit:
            raise BatchError(
                f"{where}: prompt {i} has {ids.numel()} tokens; with max_new_tokens "
                f"{p.max_new_tokens} a slot of {config.max_model_len} positions "
                f"takes prompts of at most {limit} (raise max_prompt_len)"
            )
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise BatchError(f"{where}: prompt {i} has ids outside [0, {vocab})")

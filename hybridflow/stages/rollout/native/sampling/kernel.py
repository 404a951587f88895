"""The untruncated sampler (sampler.py's `sample` with truncate=False) as two Triton kernels.

sampler.py's torch path runs ~70 kernels per decode step over [B, V] float32 logits: the
row max, logits / T - max, exp, chunk sums, then the two-level inverse CDF (on an H200 at
B = 256, V = 151,936: 439 us of a 2.83 ms Qwen2-0.5B step, bench/RESULTS.md session 12).
Here the same function is two launches and one read of the logits:

  _chunk_kernel   grid (B, C): chunk c of row b -> its max logit m_c, the first index of
                  that max, and s_c = sum exp(l / T - m_c / T) over the chunk (C = ceil(V / W))
  _draw_kernel    grid (B,): from the C (m_c, s_c): the row's max M, chunk masses
                  S_c = s_c exp(m_c / T - M / T), their running sum, the chunk holding
                  u * total; then that chunk's W logits again, its own running sum, the token.
                  Greedy rows (T <= 0) take the argmax. log-prob = l_tok / T - M / T - log(total).

Semantics are sampler.py's (its docstring): one counter-based uniform per row, the CDF of
softmax(logits / T) inverted in vocabulary order, the log-prob of the token under that
distribution, temperature-1 log-probs for greedy rows. What differs is rounding only: the
mass is summed per chunk around the chunk's max and rescaled (the torch path subtracts
the row max first), so a u that falls within a few ulps of a token boundary may pick
the neighbour, and log-probs agree to float32 rounding. Tests compare the two on a GPU.

The logits may be bfloat16 (the head's own output: upcast in registers, no float32 copy
of [B, V] is written) or float32. Nothing here syncs with the host; shapes depend on B
only, so both kernels run inside the engine's CUDA graphs.

Invariants: a row with a finite max draws a token with mass (x < the chunk running sum's
last entry, r < the chunk's cumsum last entry, as in sampler._inverse_cdf); a row whose
draw lands on no mass (NaN logits) falls back to its argmax.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.models.kernels import TRITON, runs_on
from hybridflow.stages.rollout.native.sampling.sampler import sample

if TRITON:
    import triton
    import triton.language as tl

# W: tokens per chunk. The chunk pass is B * C programs of W loads each; the draw scans C
# chunk sums and one chunk of W (sampler._CHUNK says why ~sqrt(V) keeps both small).
CHUNK = 1024
MAX_CHUNKS = 1024  # C's bound: vocabularies up to 1M tokens


if TRITON:

    @triton.jit
    def _chunk_kernel(
        logits,  # [B, V]
        stride_b,
        temp,  # [B] float32, <= 0: greedy (temperature 1)
        cmax,  # [B, C] float32 out: chunk max logit
        carg,  # [B, C] int32 out: its first index
        csum,  # [B, C] float32 out: sum exp(l / T - cmax / T)
        V,
        C,
        W: tl.constexpr,
    ):
        b = tl.program_id(0)
        c = tl.program_id(1)
        cols = c * W + tl.arange(0, W)
        live = cols < V
        t = tl.load(temp + b)
        t = tl.where(t <= 0.0, 1.0, t)
        x = tl.load(logits + b * stride_b + cols, mask=live, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        arg = tl.argmax(x, axis=0, tie_break_left=True)
        s = tl.sum(tl.where(live, tl.exp(x / t - m / t), 0.0), axis=0)
        tl.store(cmax + b * C + c, m)
        tl.store(carg + b * C + c, c * W + arg)
        tl.store(csum + b * C + c, s)

    @triton.jit
    def _below(top):
        """The largest float32 strictly below `top` (> 0): its bit pattern minus one."""
        return (top.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)

    @triton.jit
    def _draw_kernel(
        logits,  # [B, V]
        stride_b,
        temp,  # [B] float32
        u,  # [B] float32 in (0, 1)
        cmax,  # [B, C] float32
        carg,  # [B, C] int32
        csum,  # [B, C] float32
        tok_out,  # [B] int64
        lp_out,  # [B] float32
        V,
        C,
        W: tl.constexpr,
        C_PAD: tl.constexpr,
    ):
        b = tl.program_id(0)
        t0 = tl.load(temp + b)
        greedy = t0 <= 0.0
        t = tl.where(greedy, 1.0, t0)
        ci = tl.arange(0, C_PAD)
        has = ci < C
        m = tl.load(cmax + b * C + ci, mask=has, other=float("-inf"))
        s = tl.load(csum + b * C + ci, mask=has, other=0.0)
        top = tl.max(m, axis=0)  # the row's max logit
        peak = top / t
        mass = tl.where(has, s * tl.exp(m / t - peak), 0.0)  # [C_PAD] chunk masses
        total = tl.sum(mass, axis=0)
        ccdf = tl.cumsum(mass, axis=0)
        last = tl.max(tl.where(has, ccdf, 0.0), axis=0)  # the scan's own total
        # greedy / fallback: the first chunk reaching the max, its first index of it
        first = tl.minimum(tl.min(tl.where(m == top, ci, C_PAD), axis=0), C - 1)
        argmax = tl.load(carg + b * C + first).to(tl.int64)
        # level 1: the chunk whose running sum first exceeds x
        x = tl.minimum(tl.load(u + b) * last, _below(last))
        c = tl.minimum(tl.sum(tl.where(has & (ccdf <= x), 1, 0), axis=0), C - 1)
        before = tl.sum(tl.where(ci == c - 1, ccdf, 0.0), axis=0)
        # level 2: inside chunk c
        wi = tl.arange(0, W)
        cols = c * W + wi
        live = cols < V
        lx = tl.load(logits + b * stride_b + cols, mask=live, other=float("-inf")).to(tl.float32)
        e = tl.where(live, tl.exp(lx / t - peak), 0.0)
        wcdf = tl.cumsum(e, axis=0)
        wlast = tl.max(wcdf, axis=0)
        r = tl.minimum(x - before, _below(wlast))
        j = tl.minimum(tl.sum(tl.where(wcdf <= r, 1, 0), axis=0), W - 1)
        picked_mass = tl.sum(tl.where(wi == j, e, 0.0), axis=0)
        drawn = tl.where(picked_mass > 0.0, (c * W + j).to(tl.int64), argmax)
        tok = tl.where(greedy, argmax, drawn)
        ltok = tl.load(logits + b * stride_b + tok).to(tl.float32)
        tl.store(tok_out + b, tok)
        tl.store(lp_out + b, ltok / t - peak - tl.log(total))


def sample_fused(
    logits: torch.Tensor,  # [B, V] bfloat16 / float16 / float32, dense along V
    temperature: torch.Tensor,  # [B] float32, 0 = greedy
    u: torch.Tensor,  # [B] float32 in (0, 1)
    work: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sampler.sample(logits, temperature, _, _, u, truncate=False) in two kernels ->
    tokens [B] int64, log-probs [B] float32. `work`: (cmax, carg, csum) buffers of at least
    [B, C] (float32, int32, float32) to reuse, e.g. a CUDA graph's static ones."""
    b, vocab = logits.shape
    width, chunks = _chunking(vocab)
    if work is None:
        work = chunk_buffers(b, vocab, logits.device)
    cmax, carg, csum = (w[:b, :chunks] for w in work)
    tok = torch.empty(b, dtype=torch.int64, device=logits.device)
    lp = torch.empty(b, dtype=torch.float32, device=logits.device)
    temp = temperature.to(torch.float32)
    _chunk_kernel[(b, chunks)](
        logits, logits.stride(0), temp, cmax, carg, csum, vocab, chunks, W=width, num_warps=4
    )
    _draw_kernel[(b,)](
        logits,
        logits.stride(0),
        temp,
        u,
        cmax,
        carg,
        csum,
        tok,
        lp,
        vocab,
        chunks,
        W=width,
        C_PAD=triton.next_power_of_2(chunks),
        num_warps=4,
    )
    return tok, lp


def _chunking(vocab: int) -> tuple[int, int]:
    """-> (W, C): the chunk width (a power of two, at most CHUNK) and the chunk count."""
    width = min(CHUNK, 1 << max(0, vocab - 1).bit_length())
    chunks = -(-vocab // width)
    if chunks > MAX_CHUNKS:
        raise ValueError(f"vocabulary of {vocab} exceeds {MAX_CHUNKS * CHUNK} tokens")
    return width, chunks


def chunk_buffers(
    rows: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Work buffers for `sample_fused` over up to `rows` rows: [rows, C] each, made
    contiguous so that a [:b, :C] slice is what the kernels index (row stride C)."""
    c = _chunking(vocab)[1]
    return (
        torch.empty(rows, c, dtype=torch.float32, device=device),
        torch.empty(rows, c, dtype=torch.int32, device=device),
        torch.empty(rows, c, dtype=torch.float32, device=device),
    )


class StepSampler:
    """The decode step's sampling over the engine's logits buffer: the kernels for steps
    without top-k/top-p where they run (`use`), else sampler.sample (the reference, and
    every truncating step). Owns that buffer: in the head's own dtype when the kernels
    read it (bfloat16 for a bf16 head: the GEMM writes it, nothing copies it to float32),
    float32 otherwise."""

    def __init__(self, use: bool) -> None:
        self.use = use
        self.logits: torch.Tensor | None = None  # [S, V], the decode forward writes it
        self._work: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def kernels(self) -> bool:
        """True while the kernels sample (allocated where they run)."""
        return self._work is not None

    def allocate(self, rows: int, vocab: int, head: Any, autocast: bool, device: Any) -> None:
        use = self.use and runs_on(device)
        dtype = torch.float32
        if use and type(head) is torch.nn.Linear:  # FP32Linear (fp32_lm_head) stays float32
            dtype = torch.bfloat16 if autocast else head.weight.dtype
        self.logits = torch.zeros(rows, vocab, dtype=dtype, device=device)
        self._work = chunk_buffers(rows, vocab, device) if use else None

    def release(self) -> None:
        self.logits = self._work = None

    def __call__(
        self,
        b: int,  # rows 0..b-1
        temperature: torch.Tensor,  # [B] float32
        top_k: torch.Tensor,  # [B] int64
        top_p: torch.Tensor,  # [B] float32
        u: torch.Tensor,  # [B] float32
        truncate: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.logits is not None
        logits = self.logits[:b]
        if self._work is not None and not truncate:
            return sample_fused(logits, temperature, u, self._work)
        # float32 logits are passed as they are; bf16 ones (exact in float32) upcast
        return sample(logits.float(), temperature, top_k, top_p, u, truncate)

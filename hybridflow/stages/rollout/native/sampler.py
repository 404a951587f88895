"""Per-row token sampling for the native engine, in plain tensor ops (CUDA-graph safe).

Consumes logits [B, V] float32 and per-row parameters; produces the sampled token [B] and
its log-probability [B] with the semantics of the `hf` backend (rollout/hf.py docstring):
the log-prob under the distribution the token was drawn from, i.e. softmax(logits / T)
restricted to the top-k tokens (ties at the k-th logit kept), then to the top-p nucleus
(a token is dropped when the mass strictly before it reaches top_p), renormalised.
Greedy rows (temperature 0) take the argmax and report temperature-1 log-probs.

Randomness is counter-based: each row draws ONE uniform from a hash of (request seed,
row index in its request, token index), then inverts the CDF of its distribution. So a
row's samples depend only on its request's seed and its own logits, never on which other
rows share the batch or on a generator's position: continuous batching cannot change
them. One uniform per row (not Gumbel noise per vocabulary entry) keeps the cost O(B) in
hashing for a 150k vocabulary.

The hash runs on int64 tensors holding uint32 values; every product is split into 16-bit
halves so that no intermediate exceeds 2^63 (signed overflow is never relied on).
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for uint32 values `x` in int64, without overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (a bijection with full avalanche)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def split_seed(seed: int) -> tuple[int, int]:
    """A 64-bit seed as two uint32 halves (the buffers that `row_uniform` reads)."""
    seed &= (1 << 64) - 1
    return seed & _M32, seed >> 32


def row_uniform(
    seed_lo: torch.Tensor,  # [B] int64, uint32 values
    seed_hi: torch.Tensor,  # [B] int64, uint32 values
    row: torch.Tensor,  # [B] int64, the row's index in its request
    step: torch.Tensor,  # [B] int64, the index of the token being drawn
) -> torch.Tensor:
    """-> u [B] float32 in (0, 1), a pure function of (seed, row, step)."""
    h = _fmix32((step & _M32) ^ 0x9E3779B9)
    h = _fmix32(h ^ (row & _M32))
    h = _fmix32(h ^ seed_hi)
    h = _fmix32(h ^ seed_lo)
    # 23 bits: (2^23 - 0.5) is still exact in float32, so u < 1 strictly.
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def _inverse_cdf(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from exp(logp) [B, V] (rows sum to 1) with uniforms u [B] -> [B]."""
    probs = logp.exp()
    cdf = probs.cumsum(-1)  # [B, V]
    x = u * cdf[:, -1]  # scale by the total so rounding in the sum cannot leave a gap
    idx = (cdf <= x[:, None]).sum(-1)  # first index whose cdf exceeds x
    # Rounding could still point past the last token with mass (a -inf log-prob); never
    # return a token the distribution excludes.
    cols = torch.arange(logp.shape[-1], device=logp.device)
    last = torch.where(probs > 0, cols, -1).amax(-1)
    return torch.minimum(idx, last)


def sample(
    logits: torch.Tensor,  # [B, V] float32
    temperature: torch.Tensor,  # [B] float32, 0 = greedy
    top_k: torch.Tensor,  # [B] int64, 0 = off
    top_p: torch.Tensor,  # [B] float32, 1 = off
    u: torch.Tensor,  # [B] float32 in (0, 1)
    truncate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> tokens [B] int64, sampling log-probs [B] float32.

    `truncate=False` is the fast path for batches where no row uses top-k/top-p (it
    ignores them); a batch with any such row must pass True. Either way a row without
    truncation gets bit-identical results (its distribution is computed the same way, and
    the CDF is always inverted in vocabulary order), so another request's top-k/top-p can
    never change its samples."""
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / temp[:, None]  # greedy rows: temperature-1 logits
    logp = torch.log_softmax(scaled, dim=-1)  # [B, V]
    if truncate:
        vocab = logits.shape[-1]
        ordered, order = torch.sort(scaled, dim=-1, descending=True)  # [B, V]
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = ordered.gather(-1, (k - 1)[:, None])  # [B, 1]
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))  # ties at the k-th kept
        probs = torch.softmax(ordered, dim=-1)
        # top_p off: a bound above any mass, so float rounding drops nothing.
        p = torch.where(top_p < 1, top_p, torch.full_like(top_p, 2.0))
        drop = (probs.cumsum(-1) - probs) >= p[:, None]
        kept = torch.log_softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
        kept = torch.full_like(kept, float("-inf")).scatter(-1, order, kept)  # vocab order
        truncating = ((top_k > 0) | (top_p < 1)) & ~greedy  # [B]
        logp = torch.where(truncating[:, None], kept, logp)
    tok = torch.where(greedy, logits.argmax(-1), _inverse_cdf(logp, u))
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)

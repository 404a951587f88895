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

The full-vocabulary work is a few row-wise passes: the unnormalised mass
exp(logits / T - max) and one pass of chunk sums over it; probabilities, log_softmax and a
[B, V] cumsum are never materialised. The CDF is inverted in two levels (`_inverse_cdf`):
bisection over the running sum of the chunk sums finds the row's chunk, bisection over
that one chunk's cumsum finds the token; the chunk sums' total is the log-prob's
normaliser. No sum crosses rows, so a row's token and log-prob depend on its own row
alone: on CPU bit for bit whatever the batch (tested); on CUDA a reduction's order is
PyTorch's choice and may change with the shape (rounding-level, as the logits of a
batch-size-dependent GEMM already are).

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


# W, the chunk width of the two-level inverse CDF. A [B, V] cumsum is a scan that writes V
# floats per row (on an H200 at B = 256, V = 151,936: 307 us of a 3.09 ms decode step);
# the two-level search reads the mass once for the chunk sums (a reduction, no [B, V]
# output) and scans only C = ceil(V / W) chunk sums and one chunk's W entries per row.
# C + W bounds both the small scans' work and their rounding (against V for one cumsum):
# 512 keeps it near its minimum 2 sqrt(V) for 100k-250k vocabularies (809 against 780 at
# V = 151,936), and as a power of two starts every chunk 16-byte aligned when V % 4 == 0.
# (256, 512 and 1024 measure alike on CPU; the chunk-sum pass dominates.)
_CHUNK = 512


def _chunk_sums(mass: torch.Tensor) -> torch.Tensor:
    """mass [B, V] -> its sums over consecutive chunks of W = min(_CHUNK, V) tokens
    [B, C], C = ceil(V / W): one read of the mass. The last chunk may be partial: it is
    summed on its own, so the [B, V] mass is never padded (a copy of it). The chunks are
    views, so the mass must be dense along V (as `_mass` and `_truncate` make it)."""
    batch, vocab = mass.shape
    width = min(_CHUNK, vocab)
    full = vocab // width  # whole chunks
    if full * width == vocab:
        return mass.view(batch, full, width).sum(-1)
    head = mass[:, : full * width].view(batch, full, width).sum(-1)  # [B, C - 1], a view
    return torch.cat([head, mass[:, full * width :].sum(-1, keepdim=True)], -1)


def _below(top: torch.Tensor) -> torch.Tensor:
    """The largest float strictly below `top` (> 0): a bisection for a value under it
    ends at an entry that rose, i.e. a chunk or token with mass."""
    return torch.nextafter(top, torch.zeros_like(top))


def _inverse_cdf(
    mass: torch.Tensor,  # [B, V] the unnormalised mass (>= 0), vocabulary order
    chunks: torch.Tensor,  # [B, C] its `_chunk_sums`
    u: torch.Tensor,  # [B] in (0, 1)
    fallback: torch.Tensor,  # [B] int64, a token with mass
) -> torch.Tensor:
    """Index drawn from mass / mass.sum() with uniforms u -> [B]: the first index whose
    cdf exceeds u * total, in two bisections (O(log C + W) per row, no [B, V] pass).

    Invariants: x < total, so the chunk found has ccdf[c - 1] <= x < ccdf[c], hence mass;
    the remainder r = x - ccdf[c - 1] >= 0 is kept strictly below the chunk's own cumsum
    total (the chunk sum and that cumsum round differently, and r may exceed both), so the
    token found has mass too. When r is cut, it is the token at which the chunk's cumsum
    reaches its total: the chunk's last token with mass, bar ones too small to move it."""
    vocab, width = mass.shape[-1], min(_CHUNK, mass.shape[-1])
    ccdf = chunks.cumsum(-1)  # [B, C], small
    top = ccdf[:, -1:]  # scale by the scan's own total so rounding in it leaves no gap
    x = torch.minimum(u[:, None] * top, _below(top))  # [B, 1]
    c = torch.searchsorted(ccdf, x, right=True).clamp(max=ccdf.shape[-1] - 1)  # [B, 1]
    before = torch.where(c > 0, ccdf.gather(-1, (c - 1).clamp(min=0)), 0.0)  # [B, 1]
    cols = c * width + torch.arange(width, device=mass.device)  # [B, W] the chunk's tokens
    inside = mass.gather(-1, cols.clamp(max=vocab - 1))  # [B, W]
    if vocab % width:  # the last chunk is partial: its columns past V hold no mass
        inside = torch.where(cols < vocab, inside, 0.0)
    wcdf = inside.cumsum(-1)  # [B, W]
    r = torch.minimum(x - before, _below(wcdf[:, -1:]))  # [B, 1]
    j = torch.searchsorted(wcdf, r, right=True).clamp(max=width - 1)  # [B, 1]
    idx = (c * width + j).squeeze(-1).clamp(max=vocab - 1)
    # Never return a token the distribution excludes (by the invariants, only a row with
    # a NaN could): an O(B) check.
    ok = mass.gather(-1, idx[:, None]).squeeze(-1) > 0
    return torch.where(ok, idx, fallback)


def _mass(
    logits: torch.Tensor,  # [B, V]
    temp: torch.Tensor,  # [B] > 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax(logits / temp), unnormalised and never as a log_softmax: -> mass [B, V] =
    exp(logits / temp - max), the row max of logits / temp [B], the argmax [B]."""
    top, argmax = logits.max(-1)  # [B]; max(logits / T) is exactly max(logits) / T
    peak = top / temp
    mass = torch.addcdiv(-peak[:, None], logits, temp[:, None])  # logits / T - max
    return mass.exp_(), peak, argmax


def _shifted(
    logits: torch.Tensor, tok: torch.Tensor, temp: torch.Tensor, peak: torch.Tensor
) -> torch.Tensor:
    """logits[tok] / temp - peak [B], the same float ops as the [B, V] pass."""
    return logits.gather(-1, tok[:, None]).squeeze(-1) / temp - peak


def _truncate(
    logits: torch.Tensor,  # [B, V]
    temp: torch.Tensor,  # [B] > 0
    top_k: torch.Tensor,  # [B]
    top_p: torch.Tensor,  # [B]
    truncating: torch.Tensor,  # [B] bool, the rows to truncate
    mass: torch.Tensor,  # [B, V] from `_mass`
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k then top-p: -> the kept mass [B, V] (vocabulary order; other rows' `mass`
    bit for bit) and each row's top token [B] (always kept).

    The kept set is a prefix of the descending order: n_k tokens at or above the k-th
    value (ties kept), cut to n_p where the mass strictly before a token reaches top_p
    of the top-k mass (one binary search on the sorted cumsum)."""
    vocab = logits.shape[-1]
    ordered, order = torch.sort(logits / temp[:, None], dim=-1, descending=True)  # [B, V]
    k = torch.where(top_k > 0, top_k, vocab).clamp(min=1, max=vocab)
    kth = ordered.gather(-1, (k - 1)[:, None])  # [B, 1]
    n_k = (ordered >= kth).sum(-1)  # [B] top-k keeps ties at the k-th
    csum = mass.gather(-1, order).cumsum(-1)  # [B, V] mass up to and at each rank
    mass_k = csum.gather(-1, (n_k - 1)[:, None])  # [B, 1] the top-k set's mass
    p = torch.where(top_p < 1, top_p, torch.full_like(top_p, 2.0))  # off: nothing dropped
    # rank j is kept while csum[j - 1] < p * mass_k: 1 + #(csum < p * mass_k), capped.
    n_p = torch.searchsorted(csum, p[:, None] * mass_k).squeeze(-1) + 1
    n = torch.where(truncating, torch.minimum(n_k, n_p), vocab)  # [B] >= 1
    ranks = torch.arange(vocab, device=logits.device)
    keep = torch.zeros_like(ordered, dtype=torch.bool).scatter_(-1, order, ranks < n[:, None])
    return torch.where(keep, mass, 0.0), order[:, 0]


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
    truncation gets bit-identical results (its kept mass is `_mass`'s row bit for bit, and
    the CDF is always inverted in vocabulary order), so another request's top-k/top-p can
    never change its samples.

    Cost without truncation: four [B, V] passes (max, scale-and-shift, exp, chunk sums)
    and O(B (log C + W)) for the two-level search; the log-prob is logits[tok] / T - max -
    log(sum), the sum that of the chunk sums, never a full log_softmax. Truncation adds
    one sort and about seven passes (its sorted cumsum among them)."""
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    mass, peak, argmax = _mass(logits, temp)  # greedy rows: temperature 1
    fallback = argmax  # a token with mass, should the search ever land on none
    if truncate:
        truncating = ((top_k > 0) | (top_p < 1)) & ~greedy  # [B]
        mass, first = _truncate(logits, temp, top_k, top_p, truncating, mass)
        fallback = torch.where(truncating, first, argmax)
    chunks = _chunk_sums(mass)  # [B, C]
    drawn = _inverse_cdf(mass, chunks, u, fallback)
    tok = torch.where(greedy, argmax, drawn)
    # The normaliser by a reduction of the chunk sums, not a scan's last entry: tighter
    # log-probs, and no second pass over the mass.
    return tok, _shifted(logits, tok, temp, peak) - chunks.sum(-1).log()

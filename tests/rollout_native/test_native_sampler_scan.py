"""The sampler's two-level inverse CDF (`_chunk_sums` + `_inverse_cdf`): against a float64
inverse CDF, on its edge cases (one-hot rows, whole chunks of zeros, a partial last
chunk, V < W, uniforms at both ends of row_uniform's range, chunk sums that disagree
with their chunk's own scan), in seeded frequencies, and in structure: no cumsum over
the vocabulary, and a row's draw independent of the batch around it."""

from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hybridflow.stages.rollout.native.sampling.sampler import (
    _CHUNK,
    _chunk_sums,
    _inverse_cdf,
    row_uniform,
    sample,
    split_seed,
)

W = _CHUNK
U_MIN, U_MAX = 0.5 / (1 << 23), 1 - 0.5 / (1 << 23)  # row_uniform's extremes
# A token may differ from the float64 one only when u * total lies within REL_TOL * total
# of the boundary between them. The float32 steps that place a token (u * total, the
# chunk sums' scan, the chunk's own scan) each round by about 2^-24 of the total (6e-8);
# measured: at most 3e-8 on every set below, where the former full-vocabulary cumsum
# missed by up to 2e-8. 1e-6 is ~16 such roundings, still far below a token's mass in
# almost every draw here, so an index off by one fails.
REL_TOL = 1e-6
MISMATCH_TOLERANCE = 5e-3  # ... and at most this fraction of draws (measured: 2 / 1024)
NO_FALLBACK = -1  # a fallback no search may return: every draw must come from the search


def _draw(mass: torch.Tensor, u: torch.Tensor, fallback: int = NO_FALLBACK) -> torch.Tensor:
    return _inverse_cdf(mass, _chunk_sums(mass), u, torch.full_like(u, fallback, dtype=torch.long))


def _reference(mass: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first index whose float64 cdf exceeds u * total -> index [B], cdf [B, V]."""
    cdf = mass.double().cumsum(-1)
    x = u.double()[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp(max=mass.shape[-1] - 1), cdf


def _assert_matches_float64(mass: torch.Tensor, u: torch.Tensor) -> int:
    """Every draw has mass and lies within REL_TOL of its float64 cdf interval; -> the
    number of draws that differ from the float64 token."""
    tok = _draw(mass, u)
    ref, cdf = _reference(mass, u)
    assert bool((mass.gather(-1, tok[:, None]) > 0).all())
    total = cdf[:, -1]
    x = u.double() * total
    hi = cdf.gather(-1, tok[:, None]).squeeze(-1)
    lo = torch.where(tok > 0, cdf.gather(-1, (tok - 1).clamp(min=0)[:, None]).squeeze(-1), 0.0)
    miss = ((lo - x).clamp(min=0) + (x - hi).clamp(min=0)) / total  # 0 inside [lo, hi)
    assert float(miss.max()) <= REL_TOL, float(miss.max())
    return int((tok != ref).sum())


def _masses(
    gen: torch.Generator, rows: int, vocab: int, scale: float, zeros: float
) -> torch.Tensor:
    """Softmax-like rows exp(randn * scale - max), a fraction `zeros` of entries zeroed
    (as truncation does), each row keeping its max."""
    logits = torch.randn(rows, vocab, generator=gen) * scale
    mass = (logits - logits.max(-1, keepdim=True).values).exp()
    drop = (torch.rand(rows, vocab, generator=gen) < zeros) & (mass < 1)
    return mass.masked_fill(drop, 0.0)


@pytest.mark.parametrize(
    ("rows", "vocab", "scale", "zeros", "draws"),
    [
        (64, 151_936, 1.0, 0.0, 16),  # Qwen2's vocabulary, a partial last chunk
        (64, 151_936, 0.1, 0.0, 16),  # nearly flat: CDF steps ~7e-6 of the total
        (256, 5 * W + 123, 2.0, 0.0, 64),
        (256, 5 * W + 123, 2.0, 0.95, 64),  # most of the vocabulary zeroed
        (256, 8 * W, 3.0, 0.5, 64),  # whole chunks only
        (256, 300, 1.0, 0.0, 64),  # V < W: one chunk
    ],
)
def test_two_level_search_matches_the_float64_inverse_cdf(
    rows: int, vocab: int, scale: float, zeros: float, draws: int
) -> None:
    gen = torch.Generator().manual_seed(vocab + draws)
    mass = _masses(gen, rows, vocab, scale, zeros)
    differ = 0
    for i in range(draws):
        u = torch.rand(rows, generator=gen) * (U_MAX - U_MIN) + U_MIN
        if i == 0:  # both ends of the range on every row
            u[: rows // 2], u[rows // 2 :] = U_MIN, U_MAX
        differ += _assert_matches_float64(mass, u)
    assert differ <= MISMATCH_TOLERANCE * rows * draws, differ


@pytest.mark.parametrize("vocab", [1, 5, W - 1, W, W + 7, 3 * W + 100])
def test_one_hot_rows_always_draw_their_token(vocab: int) -> None:
    where = sorted({0, vocab // 2, min(W - 1, vocab - 1), min(W, vocab - 1), vocab - 1})
    u = torch.tensor([U_MIN, 1e-4, 0.25, 0.5, 0.999, U_MAX])
    for pos in where:
        mass = torch.zeros(u.numel(), vocab)
        mass[:, pos] = 3.0
        assert bool((_draw(mass, u) == pos).all()), (vocab, pos)
        mass[:, pos] = 1e-30  # tiny but positive (rows of a tiny temperature)
        assert bool((_draw(mass, u) == pos).all()), (vocab, pos)


def test_mass_concentrated_in_one_token_of_a_flat_tail() -> None:
    """One token with all but ~1e-9 of the mass, beside tokens each too small to move a
    float32 sum past it: u at either end still lands on a token with mass."""
    vocab = 4 * W + 33
    mass = torch.full((6, vocab), 1e-12)
    mass[:, 2 * W + 5] = 1.0
    u = torch.tensor([U_MIN, 1e-3, 0.5, 0.9, 1 - 1e-6, U_MAX])
    tok = _draw(mass, u)
    assert bool((tok == 2 * W + 5).all()), tok
    assert _assert_matches_float64(mass, u) == 0


def test_whole_zero_chunks_and_both_ends_of_the_uniform_range() -> None:
    """Mass in chunks 1 and 4 and in the partial last one (chunks 0, 2, 3 all zero): the
    smallest uniform draws the first token with mass, the largest the last."""
    vocab = 6 * W + 100
    cols = [W + 3, W + 400, 4 * W, 4 * W + W - 1, 6 * W + 98]
    mass = torch.zeros(3, vocab)
    mass[0, cols] = 1.0  # equal masses
    mass[1, cols[:2]] = 1.0  # the end of the vocabulary all zero
    mass[2, cols[-1]] = 1.0  # only in the partial last chunk
    first = torch.tensor([cols[0], cols[0], cols[-1]])
    last = torch.tensor([cols[-1], cols[1], cols[-1]])
    assert torch.equal(_draw(mass, torch.full((3,), U_MIN)), first)
    assert torch.equal(_draw(mass, torch.full((3,), U_MAX)), last)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        assert _assert_matches_float64(mass, torch.rand(3, generator=gen)) == 0


def test_chunk_sums_that_disagree_with_the_chunks_own_scan() -> None:
    """The chunk sums (a reduction) and a chunk's cumsum round differently, so u * total
    may point past the chosen chunk's scan total: the search is cut to the chunk's last
    token with mass. Exaggerated here by handing `_inverse_cdf` wrong chunk sums."""
    vocab = 3 * W + 10
    mass = torch.zeros(1, vocab)
    mass[0, [W + 3, W + 200, 2 * W + 5]] = 1.0  # true chunk sums: 0, 2, 1, 0
    u = torch.linspace(U_MIN, U_MAX, 401)
    rows = mass.expand(u.numel(), -1)

    def draw(chunks: list[float], fallback: int = NO_FALLBACK) -> torch.Tensor:
        sums = torch.tensor([chunks]).expand(u.numel(), -1)
        return _inverse_cdf(rows, sums, u, torch.full_like(u, fallback, dtype=torch.long))

    x = u * 4  # chunk 1 claims 3: [0, 2) its tokens, [2, 3) past its scan, [3, 4) chunk 2
    want = torch.where(x < 1, W + 3, torch.where(x < 3, W + 200, 2 * W + 5))
    assert torch.equal(draw([0.0, 3.0, 1.0, 0.0]), want)
    x = u * 2  # chunk 1 claims 1: its second token is never reached, nothing excluded
    assert torch.equal(draw([0.0, 1.0, 1.0, 0.0]), torch.where(x < 1, W + 3, 2 * W + 5))
    # A chunk claiming mass it does not hold finds none: the fallback, never a zero token.
    x = u * 4
    want = torch.where(x < 1, W + 3, torch.where(x < 2, W + 200, 2 * W + 5))
    assert torch.equal(draw([0.0, 2.0, 1.0, 1.0], fallback=7), torch.where(x < 3, want, 7))


def test_a_nan_row_stays_in_range_and_leaves_its_neighbours_alone() -> None:
    """A NaN makes the row's scans NaN: its draw is meaningless (as its log-prob), but an
    index in range that is not the NaN token (a token with mass, or the fallback), and
    no other row notices."""
    gen = torch.Generator().manual_seed(1)
    vocab = 2 * W + 9
    mass = _masses(gen, 4, vocab, 1.0, 0.0)
    u = torch.rand(4, generator=gen)
    before = _draw(mass, u)
    mass[2, W + 1] = float("nan")
    after = _inverse_cdf(mass, _chunk_sums(mass), u, torch.full((4,), 5))
    assert torch.equal(after[[0, 1, 3]], before[[0, 1, 3]])
    assert 0 <= int(after[2]) < vocab and (int(after[2]) == 5 or float(mass[2, after[2]]) > 0)


def _chi_square_bound(df: int) -> float:
    """The 1 - 1e-4 quantile of chi-square(df), Wilson-Hilferty (no scipy here)."""
    z = 3.719  # standard normal 1 - 1e-4 quantile
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_seeded_frequencies_follow_the_mass() -> None:
    """60,000 uniforms from row_uniform on one row with mass in 24 tokens spread over
    chunks (whole chunks of zeros between, some in the partial last chunk): chi-square
    below its 1 - 1e-4 quantile, and no draw outside the 24."""
    draws, vocab = 60_000, 7 * W + 77
    gen = torch.Generator().manual_seed(2)
    cols = torch.cat([torch.randperm(W, generator=gen)[:6] + c * W for c in (0, 1, 4)])
    cols = torch.cat([cols, 7 * W + torch.randperm(77, generator=gen)[:6]])
    mass = torch.zeros(vocab)
    mass[cols] = torch.rand(cols.numel(), generator=gen) + 0.05
    lo, hi = split_seed(2024)
    index = torch.arange(draws)
    u = row_uniform(torch.full((draws,), lo), torch.full((draws,), hi), index, index * 0)
    # One row, broadcast (no [draws, V] copy), in slices: the search holds [B, W] tensors.
    tok = torch.cat([_draw(mass.expand(part.numel(), -1), part) for part in u.split(5000)])
    counts = torch.bincount(tok, minlength=vocab).double()
    assert int(counts.sum()) == draws and int(counts[cols].sum()) == draws
    expected = (mass[cols] / mass.sum()).double() * draws
    chi2 = float(((counts[cols] - expected) ** 2 / expected).sum())
    assert chi2 < _chi_square_bound(cols.numel() - 1), chi2


def _cumsum_lengths(truncate: bool, rows: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=gen)
    params = (torch.ones(rows), torch.full((rows,), 5), torch.full((rows,), 0.9))
    u = torch.rand(rows, generator=gen)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        sample(logits, *params, u, truncate=truncate)
    shapes = [e.input_shapes[0] for e in prof.events() if e.name == "aten::cumsum"]
    return sorted(shape[-1] for shape in shapes)


def test_no_cumsum_runs_over_the_vocabulary() -> None:
    """Untruncated: the two scans are C chunk sums and W tokens long. Truncating: the
    sorted cumsum of `_truncate` is the one [B, V] scan."""
    vocab = 9 * W + 50
    assert _cumsum_lengths(False, 8, vocab) == [10, W]
    assert _cumsum_lengths(True, 8, vocab) == [10, W, vocab]


def test_a_rows_draw_and_logprob_do_not_depend_on_its_batch() -> None:
    """V = 151,936: every row sampled alone, bit for bit as in the batch (CPU). On two
    threads, where a full-row sum over [B, V] splits rows differently at B = 1 than at
    B = 48 (the former normaliser, mass.sum(-1), changed in 24 of these 48 rows)."""
    torch.set_num_threads(2)  # the fixture `one_thread` restores it
    gen = torch.Generator().manual_seed(4)
    rows = 48
    logits = torch.randn(rows, 151_936, generator=gen) * 3
    temp, top_k, top_p = (
        torch.full((rows,), 0.8),
        torch.zeros(rows, dtype=torch.long),
        torch.ones(rows),
    )
    u = torch.rand(rows, generator=gen)
    tok, lp = sample(logits, temp, top_k, top_p, u, truncate=False)
    for i in range(rows):
        at = slice(i, i + 1)
        one = sample(logits[at], temp[at], top_k[at], top_p[at], u[at], truncate=False)
        assert torch.equal(one[0], tok[at]) and torch.equal(one[1], lp[at]), i

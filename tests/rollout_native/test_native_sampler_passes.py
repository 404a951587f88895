"""The few-pass sampler against the former one (kept in bench/sampler.py, the reference)
and against the exact distributions: same tokens on all but boundary rows, the same
log-probs, seeded chi-square tests for temperature, top-k, top-p and their combinations,
greedy rows, -inf entries, and rows of a truncating batch untouched by it."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.stages.rollout.native.sampling.sampler import (
    _CHUNK,
    row_uniform,
    sample,
    split_seed,
)

# Tokens may differ from the reference only where float32 rounding puts u on the other
# side of a CDF boundary (the two round the CDF differently; u itself has 2^-23 steps):
# at most this fraction of rows, and every token must hold u within CDF_ATOL of its
# float64 CDF interval. Measured: 0 rows on every set below; 1 of 256 on bench/sampler.py
# (V = 151,936, flat randn * 3 logits, steps of the CDF ~1e-6), where u sat 3e-8 from a
# boundary and the former sampler also missed the float64 token.
TOKEN_MISMATCH_TOLERANCE = 1e-2
CDF_ATOL = 1e-6
LOGPROB_ATOL = 2e-6  # float32 rounding of log-probs of magnitude ~12 (V = 151,936)


def _bench() -> Any:
    """bench/sampler.py, which keeps the former sampler (sampler.py at 393e197)."""
    path = Path(__file__).parents[2] / "bench" / "sampler.py"
    spec = importlib.util.spec_from_file_location("sampler_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


_BENCH = _bench()
_old_logp = _BENCH.former_logp  # the former sampler's [B, V] distribution: the reference
_old_sample = _BENCH.former_sample_baseline  # ... and its draw


def _exact(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """The distribution in float64, from its definition: [V] probabilities."""
    scaled = logits.double() / t
    order = torch.argsort(scaled, descending=True)
    kept = torch.zeros_like(scaled, dtype=torch.bool)
    kth = scaled[order[k - 1]] if k else -math.inf
    probs = torch.softmax(scaled.masked_fill(scaled < kth, -math.inf), -1)
    before = 0.0
    for i in order.tolist():
        if probs[i] == 0 or (p < 1 and before >= p):
            break
        kept[i] = True
        before += float(probs[i])
    out = torch.where(kept, probs, 0.0)
    return out / out.sum()


def _u(rows: int, seed: int = 11) -> torch.Tensor:
    lo, hi = split_seed(seed)
    return row_uniform(
        torch.full((rows,), lo),
        torch.full((rows,), hi),
        torch.arange(rows),
        torch.zeros(rows, dtype=torch.int64),
    )


Params = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # temperature, top_k, top_p [B]


def _mixed_params(b: int, gen: torch.Generator) -> Params:
    """Per-row temperature (some greedy), top_k (some off), top_p (some off)."""
    temp = torch.tensor([0.0, 0.6, 1.0, 1.4])[torch.randint(0, 4, (b,), generator=gen)]
    top_k = torch.tensor([0, 0, 1, 5, 50])[torch.randint(0, 5, (b,), generator=gen)]
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5])[torch.randint(0, 4, (b,), generator=gen)]
    return temp, top_k, top_p


def _chi_square_bound(df: int) -> float:
    """The 1 - 1e-4 quantile of chi-square(df), Wilson-Hilferty (no scipy here)."""
    z = 3.719  # standard normal 1 - 1e-4 quantile
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _assert_matches_old(logits: torch.Tensor, params: Params, truncate: bool) -> None:
    """Tokens as the former sampler's but at CDF boundaries, every token where u falls in
    the float64 CDF, log-probs as the float64 evaluation (the exact value)."""
    u = _u(logits.shape[0])
    tok, lp = sample(logits, *params, u, truncate=truncate)
    ref_tok = _old_sample(logits, *params, u, truncate=truncate)[0]
    assert float((tok != ref_tok).float().mean()) <= TOKEN_MISMATCH_TOLERANCE
    exact = _old_logp(logits.double(), *params, truncate=truncate)  # [B, V] float64
    p = exact.exp().gather(-1, tok[:, None]).squeeze(-1)
    above = exact.exp().cumsum(-1).gather(-1, tok[:, None]).squeeze(-1)  # cdf at tok
    drawn = params[0] > 0
    assert bool((p > 0).all())
    assert bool((u >= above - p - CDF_ATOL)[drawn].all() & (u <= above + CDF_ATOL)[drawn].all())
    err = (lp.double() - exact.gather(-1, tok[:, None]).squeeze(-1)).abs()
    assert float(err.max()) <= LOGPROB_ATOL, float(err.max())


@pytest.mark.parametrize("truncate", [False, True])
def test_tokens_and_logprobs_match_the_former_sampler(truncate: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4096, 512, generator=gen) * 3
    _assert_matches_old(logits, _mixed_params(4096, gen), truncate)


@pytest.mark.parametrize("truncate", [False, True])
def test_full_vocabulary_logprobs_match_the_former_sampler(truncate: bool) -> None:
    """V = 151,936 (Qwen2): the normaliser is a sum over the whole row."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(48, 151_936, generator=gen) * 4
    _assert_matches_old(logits, _mixed_params(48, gen), truncate)


CASES = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.5, 0, 1.0),
    (1.7, 0, 1.0),
    (1.0, 4, 1.0),
    (1.0, 0, 0.7),
    (0.8, 6, 0.8),
    (1.3, 3, 0.95),
]


@pytest.mark.parametrize(("t", "k", "p"), CASES)
def test_seeded_frequencies_follow_the_exact_distribution(t: float, k: int, p: float) -> None:
    rows = 30_000
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 1.5, -0.5, 0.2, -2.0, 1.2])
    batch = logits.expand(rows, -1).contiguous()
    params = (torch.full((rows,), t), torch.full((rows,), k), torch.full((rows,), p))
    tok, lp = sample(batch, *params, _u(rows), truncate=(k > 0 or p < 1))
    exact = _exact(logits, t, k, p)
    counts = torch.bincount(tok, minlength=logits.numel()).double()
    assert bool((counts[exact == 0] == 0).all()), (counts, exact)  # nothing outside the set
    kept = exact > 0
    expected = exact[kept] * rows
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < _chi_square_bound(int(kept.sum()) - 1), (chi2, counts, exact)
    assert torch.allclose(lp.double(), exact.log()[tok], atol=1e-5)


def test_top_k_keeps_ties_at_the_k_th_and_top_p_drops_when_mass_before_reaches_p() -> None:
    rows = 20_000
    ties = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0]).expand(rows, -1).contiguous()
    one = torch.ones(rows)
    tok, _ = sample(ties, one, torch.full((rows,), 2), one, _u(rows), truncate=True)
    assert set(torch.unique(tok).tolist()) == {0, 1, 2, 3}
    # probs 0.5, 0.25, 0.125, ...: with top_p 0.6 the third token has 0.75 before it.
    halves = torch.tensor([0.0, -math.log(2), -2 * math.log(2), -3 * math.log(2)])
    halves = halves.expand(rows, -1).contiguous()
    p = torch.full((rows,), 0.6)
    tok, lp = sample(halves, one, torch.zeros(rows, dtype=torch.int64), p, _u(rows), True)
    assert set(torch.unique(tok).tolist()) == {0, 1}
    assert torch.allclose(lp, torch.log(torch.tensor([2 / 3, 1 / 3]))[tok], atol=1e-6)


@pytest.mark.parametrize("truncate", [False, True])
def test_greedy_rows_take_the_first_argmax_with_temperature_1_logprobs(truncate: bool) -> None:
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(5))
    logits[::2, 7] = logits[::2, 9] = 10.0  # a tie for the max: the first index wins
    temp = torch.zeros(64)
    top_k = torch.tensor([0, 3] * 32)
    tok, lp = sample(logits, temp, top_k, torch.full((64,), 0.5), _u(64), truncate)
    assert torch.equal(tok, logits.argmax(-1))
    assert bool((tok[::2] == 7).all())
    ref = torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
    assert torch.allclose(lp, ref, atol=1e-6)


@pytest.mark.parametrize("truncate", [False, True])
def test_rows_with_minus_inf_entries_never_sample_them(truncate: bool) -> None:
    gen = torch.Generator().manual_seed(6)
    rows, vocab = 2048, 400
    logits = torch.randn(rows, vocab, generator=gen)
    logits[torch.rand(rows, vocab, generator=gen) < 0.7] = float("-inf")
    logits[:, -50:] = float("-inf")  # a masked tail: the old guard's case
    logits[::7] = float("-inf")
    logits[::7, 123] = 0.0  # a row with a single token allowed
    params = _mixed_params(rows, gen)
    tok, lp = sample(logits, *params, _u(rows), truncate)
    assert bool(torch.isfinite(logits.gather(-1, tok[:, None])).all())
    assert bool(torch.isfinite(lp).all()) and bool((tok[::7] == 123).all())
    assert bool((lp[::7] == 0).all())
    _assert_matches_old(logits, params, truncate)


def test_u_at_the_top_of_the_range_lands_on_the_last_token_with_mass() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf"), float("-inf")]])
    one = torch.ones(1)
    u = torch.tensor([1 - 0.5 / (1 << 23)])  # the largest uniform row_uniform returns
    for truncate in (False, True):
        tok, _ = sample(logits, one, torch.zeros(1, dtype=torch.int64), one, u, truncate)
        assert int(tok) == 2


def test_untruncated_rows_are_bit_identical_beside_truncating_rows() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(256, 2000, generator=gen) * 2
    temp, top_k, top_p = _mixed_params(256, gen)
    plain = (top_k == 0) & (top_p == 1)
    a = sample(logits, temp, top_k, top_p, _u(256), truncate=False)
    b = sample(logits, temp, top_k, top_p, _u(256), truncate=True)
    assert int(plain.sum()) > 32
    assert torch.equal(a[0][plain], b[0][plain]) and torch.equal(a[1][plain], b[1][plain])
    # ... and a row's sample does not depend on which rows share its batch.
    c = sample(logits[plain], temp[plain], top_k[plain], top_p[plain], _u(256)[plain], True)
    assert torch.equal(c[0], a[0][plain]) and torch.equal(c[1], a[1][plain])


@pytest.mark.gpu
def test_sampler_captures_in_a_cuda_graph() -> None:
    gen = torch.Generator().manual_seed(8)
    logits = (torch.randn(32, 5000, generator=gen) * 3).cuda()
    temp, top_k, top_p = (x.cuda() for x in _mixed_params(32, gen))
    u = _u(32).cuda()
    for truncate in (False, True):
        eager = sample(logits, temp, top_k, top_p, u, truncate)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as graphs.py does
            sample(logits, temp, top_k, top_p, u, truncate)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = sample(logits, temp, top_k, top_p, u, truncate)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])


def test_the_bench_runs_and_counts_fewer_passes() -> None:
    """bench/sampler.py at a small size: both batches measured, the new sampler with at
    most half the former's passes over [B, V] and the same tokens. Untruncated: four
    passes (max, scale-and-shift, exp, chunk sums), no cumsum over the vocabulary.

    The vocabulary is a whole number of chunks: the bench counts an op as a pass when it
    touches at least B * V elements, and with a partial last chunk the chunk-sum pass
    reads B * (V - V % W) of them, a pass it would not count."""
    bench = _BENCH
    opts = argparse.Namespace(
        batch=8, vocab=6 * _CHUNK, device="cpu", warmup=0, repeats=1, graph=False, compile=False
    )
    out = bench.run(opts)
    json.dumps(out)
    for case in ("plain", "truncate"):
        former, new = out[case]["former"], out[case]["new"]
        assert 0 < new["full_vocab_ops"] <= former["full_vocab_ops"] * 0.7, (case, out[case])
        assert out[case]["agree"]["same_token_as_former"] == 1.0
    assert out["plain"]["new"]["full_vocab_ops"] == 4

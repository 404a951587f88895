"""Per-row counter-based sampling: determinism, distribution, top-k/top-p semantics of the
hf backend (rollout/hf.py docstring), greedy log-probs at temperature 1."""

from __future__ import annotations

import torch

from hybridflow.stages.rollout.native.sampling.sampler import row_uniform, sample, split_seed


def _u(rows: int, seed: int = 7, step: int = 0) -> torch.Tensor:
    lo, hi = split_seed(seed)
    return row_uniform(
        torch.full((rows,), lo),
        torch.full((rows,), hi),
        torch.arange(rows),
        torch.full((rows,), step),
    )


def _params(b: int, t: float = 1.0, k: int = 0, p: float = 1.0) -> tuple[torch.Tensor, ...]:
    return (torch.full((b,), t), torch.full((b,), k, dtype=torch.int64), torch.full((b,), p))


def _reference_logp(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """rollout/hf.py's `_pick` truncation, written out: [B, V] sampling log-probs."""
    scaled = logits / t
    if k:
        kth = torch.topk(scaled, k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if p < 1:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (probs.cumsum(-1) - probs) >= p
        scaled = scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.log_softmax(scaled, dim=-1)


def test_uniforms_are_a_pure_function_of_seed_row_and_step() -> None:
    a, b = _u(4096), _u(4096)
    assert torch.equal(a, b)
    assert bool((a > 0).all() and (a < 1).all())
    assert abs(float(a.mean()) - 0.5) < 0.02 and abs(float(a.var()) - 1 / 12) < 0.01
    assert not torch.equal(a, _u(4096, seed=8)) and not torch.equal(a, _u(4096, step=1))
    # No visible correlation between consecutive rows or steps.
    assert abs(float(torch.corrcoef(torch.stack([a[:-1], a[1:]]))[0, 1])) < 0.05
    assert abs(float(torch.corrcoef(torch.stack([a, _u(4096, step=1)]))[0, 1])) < 0.05


def test_samples_follow_the_softmax_distribution() -> None:
    rows = 20000
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).expand(rows, -1).contiguous()
    tok, lp = sample(logits, *_params(rows, t=0.8), _u(rows), truncate=False)
    freq = torch.bincount(tok, minlength=5).float() / rows
    probs = torch.softmax(logits[0] / 0.8, -1)
    assert torch.allclose(freq, probs, atol=0.015), (freq, probs)
    assert torch.allclose(lp, probs.log()[tok], atol=1e-6)


def test_top_k_top_p_keep_only_allowed_tokens_with_hf_logprobs() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 2
    for t, k, p in [(1.0, 5, 1.0), (0.7, 0, 0.8), (1.3, 10, 0.5), (1.0, 1, 1.0)]:
        tok, lp = sample(logits, *_params(64, t, k, p), _u(64), truncate=True)
        ref = _reference_logp(logits, t, k, p)
        assert bool(torch.isfinite(ref.gather(-1, tok[:, None])).all()), (t, k, p)
        assert torch.allclose(lp, ref.gather(-1, tok[:, None]).squeeze(-1), atol=1e-5)


def test_greedy_rows_take_argmax_and_report_temperature_1_logprobs() -> None:
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(1))
    temp = torch.tensor([0.0, 0.7, 0.0, 1.0, 0.0, 2.0])
    top_k = torch.tensor([3, 3, 0, 0, 5, 0])
    top_p = torch.tensor([0.5, 1.0, 1.0, 0.9, 1.0, 1.0])
    for truncate in (False, True):
        tok, lp = sample(logits, temp, top_k, top_p, _u(6), truncate=truncate)
        greedy = temp == 0
        assert torch.equal(tok[greedy], logits.argmax(-1)[greedy])
        ref = torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
        assert torch.allclose(lp[greedy], ref[greedy], atol=1e-6)


def test_a_row_without_truncation_is_identical_on_both_paths() -> None:
    """Another request's top-k in the same batch must not change a row's sample."""
    logits = torch.randn(32, 40, generator=torch.Generator().manual_seed(2))
    params = _params(32, t=0.9)
    a = sample(logits, *params, _u(32), truncate=False)
    b = sample(logits, *params, _u(32), truncate=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

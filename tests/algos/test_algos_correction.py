"""Rollout correction (TIS, MIS), the new KL estimators (abs, k1+, k3+) and DAPO's
shaping (overlong penalty, dynamic sampling's filter), each against its formula written
out directly on random masked inputs."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algos import (
    informative_groups,
    kl_estimate,
    kl_loss,
    overlong_penalty,
    rollout_correction,
)
from hybridflow.errors import AlgorithmInputError

B, T = 8, 6


def _pair(seed: int, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths.unsqueeze(-1)
    mask[-1] = False  # a row that is not a sequence
    rollout = -torch.rand(B, T, generator=g) * 2
    old = rollout + spread * torch.randn(B, T, generator=g)
    nan = torch.tensor(float("nan"))
    return torch.where(mask, old, nan), torch.where(mask, rollout, nan), mask


# ------------------------------------------------------------------ TIS / MIS


@pytest.mark.parametrize("seed", range(4))
def test_tis_is_the_truncated_token_ratio(seed):
    old, rollout, mask = _pair(seed)
    cap = 1.3
    out = rollout_correction(old, rollout, mask, "tis", cap=cap)
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                ratio = torch.exp(old[i, t] - rollout[i, t])
                assert out.weights[i, t].item() == pytest.approx(min(ratio.item(), cap), rel=1e-5)
            else:
                assert out.weights[i, t].item() == 0.0
    assert torch.equal(out.mask, mask)  # TIS drops nothing
    r = torch.exp(old[mask] - rollout[mask])
    assert out.stats["masked_frac"].item() == pytest.approx((r > cap).float().mean().item())
    assert out.stats["weight_max"].item() <= cap + 1e-6
    assert out.stats["weight_mean"].item() == pytest.approx(r.clamp(max=cap).mean().item(), 1e-5)
    # mismatch KL(mu || pi_old): k1 = mean(log mu - log pi_old), k3 = mean(e^-d + d - 1)
    d = rollout[mask] - old[mask]
    assert out.stats["mismatch_kl"].item() == pytest.approx(d.mean().item(), rel=1e-5, abs=1e-7)
    k3 = (torch.exp(-d) + d - 1).mean().item()
    assert out.stats["mismatch_k3"].item() == pytest.approx(k3, rel=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_mis_keeps_sequences_whose_ratio_is_in_bounds(seed):
    old, rollout, mask = _pair(seed, spread=0.4)
    low, high = 0.7, 1.5
    out = rollout_correction(old, rollout, mask, "mis", low=low, high=high)
    dropped = 0
    for i in range(B - 1):
        m = mask[i]
        rho = torch.exp((old[i][m] - rollout[i][m]).sum()).item()  # prod_t pi_old / mu
        if low <= rho <= high:
            assert torch.equal(out.mask[i], m)
            assert torch.allclose(out.weights[i][m], torch.full((int(m.sum()),), rho), rtol=1e-5)
        else:
            dropped += 1
            assert not bool(out.mask[i].any()) and bool((out.weights[i] == 0).all())
    assert not bool(out.mask[-1].any())
    assert out.stats["masked_frac"].item() == pytest.approx(dropped / (B - 1))


def test_correction_with_no_mismatch_is_the_identity():
    old, _, mask = _pair(0)
    for mode in ("tis", "mis"):
        out = rollout_correction(old, old, mask, mode)
        assert torch.equal(out.mask, mask)
        assert bool((out.weights[mask] == 1).all())
        assert out.stats["mismatch_kl"].item() == 0.0 and out.stats["masked_frac"].item() == 0.0
    with pytest.raises(AlgorithmInputError, match="unknown mode"):
        rollout_correction(old, old, mask, "xis")
    with pytest.raises(AlgorithmInputError, match="low <= 1 <= high"):
        rollout_correction(old, old, mask, "mis", low=1.2)


# ------------------------------------------------------------------ KL estimators


def test_abs_and_straight_through_estimators():
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(B, T, generator=g) > 0.3
    ref = -torch.rand(B, T, generator=g) * 2
    lp = (ref + 0.5 * torch.randn(B, T, generator=g)).requires_grad_(True)
    d = (lp - ref).detach()
    want = {
        "abs": d.abs(),
        "k1+": d,
        "k3+": torch.exp(-d) + d - 1,
    }
    for kind, value in want.items():
        kl = kl_estimate(lp, ref, kind, mask)
        assert torch.allclose(kl[mask], value[mask], atol=1e-6), kind
        assert bool((kl[~mask] == 0).all())
        (grad,) = torch.autograd.grad(kl.sum(), lp)
        expected = torch.sign(d) if kind == "abs" else d  # d/dlp of 0.5 d^2 is d (k2)
        assert torch.allclose(grad[mask], expected[mask], atol=1e-6), kind
        assert bool((grad[~mask] == 0).all())
    # as a loss term: value of k1, gradient of k2
    term, _ = kl_loss(lp, ref, mask, 1.0, "k1+")
    assert term.item() == pytest.approx(d[mask].mean().item(), rel=1e-5)
    (grad,) = torch.autograd.grad(term, lp)
    assert torch.allclose(grad[mask], d[mask] / mask.sum(), atol=1e-7)


# ------------------------------------------------------------------ DAPO shaping


def test_overlong_penalty_is_dapo_eq_13():
    max_len, cache = 20, 4

    def r_len(n: int) -> float:
        if n <= max_len - cache:
            return 0.0
        if n <= max_len:
            return ((max_len - cache) - n) / cache
        return -1.0

    lengths = torch.arange(0, 26)
    got = overlong_penalty(lengths, max_len, cache)
    assert got.tolist() == pytest.approx([r_len(n) for n in range(26)])
    assert overlong_penalty(lengths, max_len, cache, 0.5).tolist() == pytest.approx(
        [0.5 * r_len(n) for n in range(26)]
    )
    with pytest.raises(AlgorithmInputError, match="buffer_len"):
        overlong_penalty(lengths, 4, 5)


def test_informative_groups_drops_zero_variance_groups():
    g = torch.Generator().manual_seed(0)
    groups = torch.tensor([7, 7, 7, 2, 2, 2, 9, 9, 9, 4, 4, 4])[torch.randperm(12, generator=g)]
    scores = torch.rand(12, generator=g)
    scores[groups == 2] = 1.0  # all right
    scores[groups == 9] = 0.0  # all wrong
    keep = informative_groups(scores, groups)
    for k in (7, 2, 9, 4):
        spread = scores[groups == k].max() - scores[groups == k].min()
        assert bool((keep[groups == k] == (spread > 0)).all())
    assert int(keep.sum()) == 6
    assert not bool(informative_groups(scores, groups, atol=2.0).any())

"""GSPO, CISPO, Dr. GRPO's aggregation, the policy-loss dispatch and loss weights, each
against its paper's formula written out directly on random masked inputs (value AND
gradient), with NaN garbage at padding that must change nothing."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algos import (
    POLICY_LOSSES,
    aggregate,
    cispo_policy_loss,
    compute_advantages,
    gspo_policy_loss,
    policy_loss,
    ppo_policy_loss,
)
from hybridflow.errors import AlgorithmInputError

B, T = 6, 7


def _inputs(seed: int, *, per_seq_adv: bool = True, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.bool)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask &= torch.arange(T) < lengths.unsqueeze(-1)
    mask[2, 1] = False  # an interior hole (a tool span) as well
    old = -torch.rand(B, T, generator=g) * 3
    new = (old + spread * torch.randn(B, T, generator=g)).requires_grad_(False)
    if per_seq_adv:
        adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    else:
        adv = torch.randn(B, T, generator=g)
    # garbage at padding: must not reach any value or gradient
    nan = torch.tensor(float("nan"))
    old = torch.where(mask, old, nan)
    new = torch.where(mask, new, nan)
    adv = torch.where(mask, adv, nan)
    return new.clone().requires_grad_(True), old, adv, mask


def _grad(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


# ------------------------------------------------------------------ GSPO


def _gspo_reference(new, old, adv, mask, lo, hi):
    """arXiv 2507.18071 eq. (5)-(7), sequence by sequence, no tensor tricks."""
    terms = []
    for i in range(B):
        m = mask[i]
        s = torch.exp((new[i][m] - old[i][m]).mean())  # s_i(theta)
        a = adv[i][m][0]  # one advantage per sequence
        terms.append(torch.minimum(s * a, s.clamp(1 - lo, 1 + hi) * a))
    return -torch.stack(terms).mean()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.28), (0.9, 5.0)])
def test_gspo_matches_the_paper_in_value_and_gradient(seed, clip):
    new, old, adv, mask = _inputs(seed)
    ref_new = torch.where(mask, new.detach(), 0.0).requires_grad_(True)
    ref = _gspo_reference(ref_new, old, adv, mask, *clip)
    loss, stats = gspo_policy_loss(new, old, adv, mask, *clip)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    g, g_ref = _grad(loss, new), _grad(ref, ref_new)
    assert torch.allclose(torch.where(mask, g, 0.0), g_ref, atol=1e-6)
    assert bool((g[~mask] == 0).all())  # NaN at padding, yet a zero gradient there
    s = torch.stack([torch.exp((new[i][mask[i]] - old[i][mask[i]]).mean()) for i in range(B)])
    clipped = (s < 1 - clip[0]) | (s > 1 + clip[1])
    assert 0.0 <= stats["pg_clipfrac"].item() <= clipped.float().mean().item() + 1e-6
    assert stats["seq_ratio_mean"].item() == pytest.approx(s.mean().item(), rel=1e-5)


def test_gspo_clips_whole_sequences():
    new, old, adv, mask = _inputs(1, spread=1.0)
    _, st = gspo_policy_loss(new, old, adv.abs(), mask, 1e-4, 1e-4)  # A > 0: s > 1 clips
    s = torch.stack([torch.exp((new[i][mask[i]] - old[i][mask[i]]).mean()) for i in range(B)])
    assert st["pg_clipfrac"].item() == pytest.approx((s > 1 + 1e-4).float().mean().item())


def test_gspo_on_policy_equals_ppo_on_policy_under_seq_mean():
    # ratio 1 everywhere: both are -A with gradient -A * grad log pi / |y_i| per token
    _, old, adv, mask = _inputs(2)
    new = old.clone().requires_grad_(True)
    a, _ = gspo_policy_loss(new, old, adv, mask, 0.2, 0.2, "seq-mean-token-mean")
    new2 = old.clone().requires_grad_(True)
    b, _ = ppo_policy_loss(new2, old, adv, mask, 0.2, 0.2, agg="seq-mean-token-mean")
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    assert torch.allclose(_grad(a, new)[mask], _grad(b, new2)[mask], atol=1e-6)


# ------------------------------------------------------------------ CISPO


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_cispo_matches_minimax_m1_in_value_and_gradient(seed, agg):
    """J = 1/sum|o_i| sum_i sum_t sg(clip(r_it, 1 - eps_l, 1 + eps_h)) A_it log pi(o_it)."""
    lo, hi = 0.5, 0.3
    new, old, adv, mask = _inputs(seed, per_seq_adv=False, spread=0.6)
    ref_new = torch.where(mask, new.detach(), 0.0).requires_grad_(True)
    r = torch.exp(ref_new.detach() - torch.where(mask, old, 0.0))
    w = r.clamp(1 - lo, 1 + hi)  # a constant: no gradient flows through the weight
    per_token = torch.where(mask, -w * torch.where(mask, adv, 0.0) * ref_new, 0.0)
    if agg == "token-mean":
        ref = per_token.sum() / mask.sum()
    else:
        ref = (per_token.sum(-1) / mask.sum(-1)).mean()
    loss, st = cispo_policy_loss(new, old, adv, mask, lo, hi, agg)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    g = _grad(loss, new)
    assert torch.allclose(torch.where(mask, g, 0.0), _grad(ref, ref_new), atol=1e-6)
    # every valid token keeps a gradient (unlike PPO, clipping only caps the weight)
    assert bool((g[mask & (torch.where(mask, adv, 0.0) != 0)] != 0).all())
    assert st["pg_clipfrac"].item() == pytest.approx(
        ((r != w) & mask).sum().item() / mask.sum().item()
    )


# ------------------------------------------------------------------ Dr. GRPO


def test_seq_mean_token_sum_norm_divides_by_a_constant():
    loss = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [4.0, 5.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    # (1/B) sum_i sum_t l_it / L  with L = 10
    got = aggregate(loss, mask, "seq-mean-token-sum-norm", norm_len=10)
    assert got.item() == pytest.approx(((1 + 2 + 3) / 10 + 4 / 10) / 2)
    with pytest.raises(AlgorithmInputError, match="norm_len"):
        aggregate(loss, mask, "seq-mean-token-sum-norm")


@pytest.mark.parametrize("seed", range(3))
def test_dr_grpo_objective_matches_the_paper(seed):
    """Dr. GRPO (arXiv 2503.20783 eq. 3): A_i = R_i - mean(R_group) (no std), and
    J = (1/G) sum_i sum_t min(r A, clip(r) A) / L_max  (a constant, not |o_i|)."""
    g = torch.Generator().manual_seed(seed)
    new, old, _, mask = _inputs(seed)
    scores = torch.rand(B, generator=g)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = compute_advantages("dr_grpo", scores=scores, group_index=groups, mask=mask).advantages
    centred = scores - torch.stack([scores[groups == k].mean() for k in groups.tolist()])
    assert torch.allclose(adv[mask], centred.unsqueeze(-1).expand(B, T)[mask], atol=1e-6)
    same = compute_advantages(
        "grpo", scores=scores, group_index=groups, mask=mask, norm_std=False
    ).advantages
    assert torch.equal(adv, same)
    big_l = 16
    loss, _ = ppo_policy_loss(
        new, old, adv, mask, 0.2, 0.2, agg="seq-mean-token-sum-norm", norm_len=big_l
    )
    ref_new = torch.where(mask, new.detach(), 0.0)
    r = torch.exp(ref_new - torch.where(mask, old, 0.0))
    surrogate = torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
    ref = -(torch.where(mask, surrogate, 0.0).sum(-1) / big_l).mean()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)


# ------------------------------------------------------------------ dispatch, weights


def test_policy_loss_dispatch_and_weights():
    assert POLICY_LOSSES == ("ppo", "gspo", "cispo")
    new, old, adv, mask = _inputs(5, per_seq_adv=False)
    for name in POLICY_LOSSES:
        a, _ = policy_loss(name, new, old, adv, mask, 0.2, 0.3, "token-mean")
        # weights of 1 change nothing; weights of 2 double the loss
        ones = torch.ones(B, T)
        b, _ = policy_loss(name, new, old, adv, mask, 0.2, 0.3, "token-mean", weights=ones)
        c, _ = policy_loss(name, new, old, adv, mask, 0.2, 0.3, "token-mean", weights=2 * ones)
        assert a.item() == pytest.approx(b.item()) and c.item() == pytest.approx(2 * a.item())
    with pytest.raises(AlgorithmInputError, match="unknown"):
        policy_loss("ppp", new, old, adv, mask, 0.2, 0.3, "token-mean")
    with pytest.raises(AlgorithmInputError, match="dual_clip_c is PPO's"):
        policy_loss("gspo", new, old, adv, mask, 0.2, 0.3, "token-mean", dual_clip_c=3.0)

"""KL estimators, controllers, reward penalty and loss term on hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algos import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_estimate,
    kl_loss,
    make_kl_controller,
)
from hybridflow.errors import AlgorithmInputError

NAN = float("nan")
# log_ratio = logprobs - ref = [0.5, -1.0]
LP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])


def test_k1_k2_k3_by_hand_with_sign_conventions():
    k1 = kl_estimate(LP, REF, "k1")
    assert k1.tolist() == [pytest.approx([0.5, -1.0])]
    # policy likes its own token more than the reference does -> k1 > 0, and vice versa
    assert k1[0, 0] > 0 > k1[0, 1]
    assert kl_estimate(LP, REF, "k2").tolist() == [pytest.approx([0.125, 0.5])]
    # k3 with d = ref - logp = [-0.5, 1.0]: e^d - d - 1
    k3 = kl_estimate(LP, REF, "k3")
    assert k3.tolist() == [pytest.approx([math.exp(-0.5) - 0.5, math.e - 2.0])]
    assert (k3 >= 0).all()
    # verl's names are aliases
    for alias, kind in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        assert torch.equal(kl_estimate(LP, REF, alias), kl_estimate(LP, REF, kind))
    # identical policies: every estimator is exactly 0
    for kind in ("k1", "k2", "k3"):
        assert kl_estimate(LP, LP, kind).abs().max().item() == 0.0


def test_k1_and_k3_are_unbiased_in_expectation_under_the_policy():
    # p = [1/2, 1/4, 1/4], q = [1/4, 1/2, 1/4]: KL(p||q) = 1/2 ln2 + 1/4 ln(1/2) = ln2 / 4
    p = torch.tensor([[0.5, 0.25, 0.25]])
    q = torch.tensor([[0.25, 0.5, 0.25]])
    true_kl = math.log(2) / 4
    for kind in ("k1", "k3"):
        expectation = (p * kl_estimate(p.log(), q.log(), kind)).sum().item()
        assert expectation == pytest.approx(true_kl, rel=1e-6)
    # k2 is biased: E_p[0.5 (ln p/q)^2] = 0.5 * (0.5 + 0.25) * ln2^2
    k2 = (p * kl_estimate(p.log(), q.log(), "k2")).sum().item()
    assert k2 == pytest.approx(0.375 * math.log(2) ** 2, rel=1e-6)


def test_k3_clamp_and_finite_gradient_for_extreme_ratios():
    lp = torch.tensor([[-6.0, -100.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, 0.0]])
    # d = 5: e^5 - 6 = 142.41...; clamped at 10 by default
    assert kl_estimate(lp, ref, "k3", k3_clamp=None)[0, 0].item() == pytest.approx(math.exp(5) - 6)
    out = kl_estimate(lp, ref, "k3")
    assert out.tolist() == [[10.0, 10.0]]
    out.sum().backward()
    assert torch.isfinite(lp.grad).all()


def test_masked_estimate_zero_at_padding_whatever_is_there():
    m = torch.tensor([[1, 0]])
    for kind in ("k1", "k2", "k3"):
        a = kl_estimate(LP, REF, kind, m)
        b = kl_estimate(torch.tensor([[-1.0, NAN]]), torch.tensor([[-1.5, float("inf")]]), kind, m)
        assert torch.equal(a, b) and a[0, 1] == 0
    with pytest.raises(AlgorithmInputError, match="unknown kind 'k4'"):
        kl_estimate(LP, REF, "k4")


def test_fixed_controller_is_constant():
    c = FixedKLController(0.05)
    c.update(10.0, 100)
    assert c.value == 0.05


def test_adaptive_controller_moves_in_the_right_direction_by_the_right_amount():
    c = AdaptiveKLController(0.1, target_kl=0.05, horizon=100)
    c.update(0.1, n_steps=10)  # KL 2x target -> error clipped to +0.2 -> x (1 + 0.2 * 0.1)
    assert c.value == pytest.approx(0.102)
    c.update(0.0, n_steps=10)  # KL far below -> error clipped to -0.2 -> x 0.98
    assert c.value == pytest.approx(0.102 * 0.98)
    before = c.value
    c.update(0.055, n_steps=50)  # error 0.1 (inside the clip) -> x (1 + 0.1 * 0.5)
    assert c.value == pytest.approx(before * 1.05)
    c.update(0.05, n_steps=50)  # on target -> unchanged
    assert c.value == pytest.approx(before * 1.05)
    assert isinstance(
        make_kl_controller("adaptive", 0.1, target_kl=1, horizon=1), AdaptiveKLController
    )
    with pytest.raises(AlgorithmInputError):
        make_kl_controller("adaptive", 0.1)
    with pytest.raises(AlgorithmInputError):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)


def test_apply_kl_penalty_from_scores_and_from_token_rewards():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    kl = torch.tensor([[0.1, 0.2, NAN], [0.4, 9.0, 9.0]])
    out, stats = apply_kl_penalty(torch.tensor([1.0, 2.0]), kl, 0.5, mask)
    # row 0: [0 - 0.05, 1 - 0.1, 0] ; row 1: [2 - 0.2, 0, 0]
    assert out.tolist() == [pytest.approx([-0.05, 0.9, 0.0]), pytest.approx([1.8, 0.0, 0.0])]
    # per-sequence mean KL 0.15 and 0.4 -> 0.275
    assert stats["kl"].item() == pytest.approx(0.275)
    assert stats["kl_coef"].item() == 0.5
    token_rewards = torch.tensor([[0.0, 1.0, NAN], [2.0, NAN, NAN]])
    out2, _ = apply_kl_penalty(token_rewards, kl, 0.5, mask)
    assert torch.equal(out, out2)


def test_kl_loss_value_and_gradient():
    lp = LP.clone().requires_grad_(True)
    loss, stats = kl_loss(lp, REF, torch.ones(1, 2), coef=0.1, kind="k1")
    assert loss.item() == pytest.approx(0.1 * (0.5 - 1.0) / 2)
    assert stats["kl_loss"].item() == pytest.approx(-0.25)
    loss.backward()
    assert lp.grad.tolist() == [pytest.approx([0.05, 0.05])]
    # k3: d/dlogp [e^(ref-logp) - (ref-logp) - 1] = 1 - e^(ref-logp)
    lp.grad = None
    loss, _ = kl_loss(lp, REF, torch.ones(1, 2), coef=0.1, kind="k3")
    loss.backward()
    expect = [0.1 / 2 * (1 - math.exp(-0.5)), 0.1 / 2 * (1 - math.e)]
    assert lp.grad.tolist() == [pytest.approx(expect)]

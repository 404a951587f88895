"""Advantage estimators against hand-unrolled numbers."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algos import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    gae,
    grpo_advantages,
    reinforce_pp,
    rloo,
)
from hybridflow.errors import AlgorithmInputError

NAN = float("nan")


def rows(t: torch.Tensor) -> list[list[float]]:
    return [pytest.approx(r, abs=1e-5) for r in t.tolist()]


# ------------------------------------------------------------------ GAE

# Row 0: three valid tokens + one padding slot. Row 1: one valid token.
GAE_R = torch.tensor([[0.0, 0.5, 1.0, 9.0], [2.0, 9.0, 9.0, 9.0]])
GAE_V = torch.tensor([[0.2, 0.4, 0.6, 9.0], [0.5, 9.0, 9.0, 9.0]])
GAE_M = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])


def test_gae_hand_unrolled_three_tokens():
    # gamma = 0.9, lam = 0.8, gamma * lam = 0.72; V after the last valid token is 0.
    # t=2: delta = 1.0 + 0.9*0   - 0.6 = 0.4    A2 = 0.4
    # t=1: delta = 0.5 + 0.9*0.6 - 0.4 = 0.64   A1 = 0.64 + 0.72*0.4   = 0.928
    # t=0: delta = 0.0 + 0.9*0.4 - 0.2 = 0.16   A0 = 0.16 + 0.72*0.928 = 0.82816
    # row 1: A0 = 2.0 - 0.5 = 1.5 (the padding's 9s are not bootstrapped from)
    adv, ret = gae(GAE_R, GAE_V, GAE_M, gamma=0.9, lam=0.8, whiten=False)
    assert adv.tolist() == rows(torch.tensor([[0.82816, 0.928, 0.4, 0], [1.5, 0, 0, 0]]))
    assert ret.tolist() == rows(torch.tensor([[1.02816, 1.328, 1.0, 0], [2.0, 0, 0, 0]]))


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    adv, ret = gae(GAE_R, GAE_V, GAE_M, gamma=1.0, lam=1.0, whiten=False)
    # reward-to-go of row 0: 1.5, 1.5, 1.0
    assert adv.tolist() == rows(torch.tensor([[1.3, 1.1, 0.4, 0], [1.5, 0, 0, 0]]))
    assert ret.tolist() == rows(torch.tensor([[1.5, 1.5, 1.0, 0], [2.0, 0, 0, 0]]))


def test_gae_skips_interior_padding():
    # mask [1, 0, 1]: the middle slot is not a time step, so this is the 2-token case
    # r = [0, 1], V = [0.2, 0.6]:  A1 = 0.4 ; A0 = 0 + 0.9*0.6 - 0.2 + 0.72*0.4 = 0.628
    r = torch.tensor([[0.0, 7.0, 1.0]])
    v = torch.tensor([[0.2, -3.0, 0.6]])
    adv, ret = gae(r, v, torch.tensor([[1, 0, 1]]), gamma=0.9, lam=0.8, whiten=False)
    assert adv.tolist() == rows(torch.tensor([[0.628, 0.0, 0.4]]))
    assert ret.tolist() == rows(torch.tensor([[0.828, 0.0, 1.0]]))


def test_gae_whitened_has_zero_mean_unit_var_and_ignores_garbage():
    adv, ret = gae(GAE_R, GAE_V, GAE_M, gamma=0.9, lam=0.8)
    valid = adv[GAE_M.bool()]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.var(unbiased=True).item() == pytest.approx(1.0, abs=1e-5)
    # whitening is a monotone map of the hand values 0.82816, 0.928, 0.4, 1.5
    assert valid.argsort().tolist() == [2, 0, 1, 3]
    pad = ~GAE_M.bool()
    adv2, ret2 = gae(GAE_R.masked_fill(pad, NAN), GAE_V.masked_fill(pad, -1e30), GAE_M, 0.9, 0.8)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert (adv[pad] == 0).all()


def test_gae_rejects_bad_discount_and_shapes():
    with pytest.raises(AlgorithmInputError, match="lam"):
        gae(GAE_R, GAE_V, GAE_M, gamma=0.9, lam=1.5)
    with pytest.raises(AlgorithmInputError, match="values"):
        gae(GAE_R, GAE_V[:, :3], GAE_M)


# ------------------------------------------------------------------ GRPO / RLOO

# Interleaved, non-contiguous prompt ids: group 7 = scores 1, 0, 0 ; group 3 = 2, 4.
SCORES = torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0])
GROUPS = torch.tensor([7, 3, 7, 3, 7])
MASK5 = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]])


def test_grpo_with_std_normalisation():
    # group 7: mean 1/3, unbiased var ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3, std 1/sqrt(3)
    # group 3: mean 3, var (1 + 1) / 1 = 2, std sqrt(2)
    s3, s2 = 1 / math.sqrt(3), math.sqrt(2)
    per_seq = [(2 / 3) / s3, -1 / s2, (-1 / 3) / s3, 1 / s2, (-1 / 3) / s3]
    adv = grpo_advantages(SCORES, GROUPS, MASK5)
    for i, a in enumerate(per_seq):
        expect = [a if MASK5[i, t] else 0.0 for t in range(3)]
        assert adv[i].tolist() == pytest.approx(expect, rel=1e-5)


def test_grpo_without_std_normalisation():
    adv = grpo_advantages(SCORES, GROUPS, MASK5, norm_std=False)
    assert adv.tolist() == rows(
        torch.tensor(
            [[2 / 3, 2 / 3, 0], [-1, 0, 0], [-1 / 3, -1 / 3, -1 / 3], [1, 1, 0], [-1 / 3, 0, 0]]
        )
    )


def test_grpo_identical_scores_give_zero_not_nan():
    adv = grpo_advantages(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), torch.ones(2, 2))
    assert adv.tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_rloo_leave_one_out_values():
    # group 7 (1, 0, 0): 1 - mean(0, 0) = 1 ; 0 - mean(1, 0) = -0.5
    # group 3 (2, 4):    2 - 4 = -2 ; 4 - 2 = 2
    adv = rloo(SCORES, GROUPS, MASK5)
    assert adv.tolist() == rows(
        torch.tensor([[1, 1, 0], [-2, 0, 0], [-0.5, -0.5, -0.5], [2, 2, 0], [-0.5, 0, 0]])
    )


def test_group_of_one_is_a_clear_error():
    for fn in (rloo, grpo_advantages):
        with pytest.raises(AlgorithmInputError, match=r"groups \[5\] have a single sample"):
            fn(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4, 4, 5]), torch.ones(3, 2))
    with pytest.raises(AlgorithmInputError, match="integer"):
        rloo(SCORES, GROUPS.float(), MASK5)


# ------------------------------------------------------------------ REINFORCE++


def test_reinforce_pp_discounted_returns_and_whitening():
    # gamma = 0.5. row 0: r = [0, 0, 1] -> G = [0.25, 0.5, 1] ; row 1: r = [0, 2] -> G = [1, 2]
    r = torch.tensor([[0.0, 0.0, 1.0, 5.0], [0.0, 2.0, 5.0, 5.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = reinforce_pp(r, m, gamma=0.5)
    assert ret.tolist() == rows(torch.tensor([[0.25, 0.5, 1.0, 0], [1.0, 2.0, 0, 0]]))
    # valid G: 0.25 0.5 1 1 2 -> mean 0.95, squared deviations sum 1.8, unbiased var 0.45
    sd = math.sqrt(0.45)
    expect = [[-0.7 / sd, -0.45 / sd, 0.05 / sd, 0], [0.05 / sd, 1.05 / sd, 0, 0]]
    assert adv.tolist() == rows(torch.tensor(expect))
    adv2, ret2 = reinforce_pp(r.masked_fill(m == 0, NAN), m, gamma=0.5)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_reinforce_pp_skips_interior_padding():
    # mask [1, 0, 1] with gamma 0.5: the middle slot is no time step -> G = [0.5, 0, 1]
    r = torch.tensor([[0.0, 7.0, 1.0], [1.0, 0.0, 0.0]])
    m = torch.tensor([[1, 0, 1], [1, 0, 0]])
    _, ret = reinforce_pp(r, m, gamma=0.5)
    assert ret.tolist() == rows(torch.tensor([[0.5, 0.0, 1.0], [1.0, 0.0, 0.0]]))


def test_reinforce_pp_group_baseline():
    # gamma = 1, outcome rewards: group 5 scores 1, 0 (2 tokens each); group 9 scores 3, 1
    # (1 token each). Baselines 0.5 and 2 -> centred 0.5, -0.5, 1, -1 per token.
    # valid values .5 .5 -.5 -.5 1 -1: mean 0, sum of squares 3, unbiased var 3/5
    r = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [3.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 0, 0]])
    adv, ret = reinforce_pp(r, m, gamma=1.0, group_index=torch.tensor([5, 5, 9, 9]))
    sd = math.sqrt(0.6)
    expect = [[0.5 / sd, 0.5 / sd, 0], [-0.5 / sd, -0.5 / sd, 0], [1 / sd, 0, 0], [-1 / sd, 0, 0]]
    assert adv.tolist() == rows(torch.tensor(expect))
    assert ret.tolist() == rows(torch.tensor([[1, 1, 0], [0, 0, 0], [3, 0, 0], [1, 0, 0]]))


# ------------------------------------------------------------------ dispatch


def test_registry_flags():
    assert set(ADVANTAGE_ESTIMATORS) == {
        "gae",
        "grpo",
        "dr_grpo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "rloo",
    }
    assert [n for n, s in ADVANTAGE_ESTIMATORS.items() if s.needs_critic] == ["gae"]
    assert {n for n, s in ADVANTAGE_ESTIMATORS.items() if s.needs_groups} == {
        "grpo",
        "dr_grpo",
        "reinforce_pp_baseline",
        "rloo",
    }


def test_compute_advantages_converts_between_scores_and_token_rewards():
    token_rewards = torch.zeros(5, 3)
    for i, length in enumerate(MASK5.sum(-1).tolist()):
        token_rewards[i, length - 1] = SCORES[i]
    by_scores = compute_advantages("rloo", scores=SCORES, group_index=GROUPS, mask=MASK5)
    by_tokens = compute_advantages(
        "rloo", token_rewards=token_rewards, group_index=GROUPS, mask=MASK5
    )
    assert torch.equal(by_scores.advantages, by_tokens.advantages)
    assert by_scores.returns is None
    # gae with scores: placed on the last valid token, same as GAE_R's row 1 layout
    res = compute_advantages(
        "gae",
        scores=torch.tensor([2.0]),
        values=torch.tensor([[0.5, 0.0]]),
        mask=torch.tensor([[1, 0]]),
        gamma=0.9,
        lam=0.8,
        whiten=False,
        norm_std=True,
    )  # norm_std belongs to grpo: ignored here
    assert res.advantages.tolist() == [[1.5, 0.0]] and res.returns.tolist() == [[2.0, 0.0]]


def test_compute_advantages_errors():
    kw = {"scores": SCORES, "group_index": GROUPS, "mask": MASK5}
    with pytest.raises(AlgorithmInputError, match="unknown estimator 'ppo'"):
        compute_advantages("ppo", **kw)
    with pytest.raises(AlgorithmInputError, match="lamda"):
        compute_advantages("grpo", lamda=0.9, **kw)
    with pytest.raises(AlgorithmInputError, match="exactly one"):
        compute_advantages("grpo", token_rewards=torch.zeros(5, 3), **kw)
    with pytest.raises(AlgorithmInputError, match="needs `values`"):
        compute_advantages("gae", scores=SCORES, mask=MASK5)
    with pytest.raises(AlgorithmInputError, match="needs `group_index`"):
        compute_advantages("reinforce_pp_baseline", scores=SCORES, mask=MASK5)

"""Every advantage estimator on multi-turn responses: a response whose mask has an
interior span of zeros (observation tokens), against a hand computation. Observation
positions are not time steps: they get no advantage, no return, no reward, and the
recursions (GAE, REINFORCE++) jump over them (verl's multi-turn GAE does the same)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algos.advantages import compute_advantages, gae, reinforce_pp
from hybridflow.algos.kl import apply_kl_penalty
from hybridflow.algos.losses import aggregate

# row 0: model t0 t1 | observation t2 t3 | model t4 | padding t5
# row 1: model t0 | observation t1 | model t2 t3 | padding t4 t5
MASK = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 1, 1, 0, 0]])
VALID = [[0, 1, 4], [0, 2, 3]]


def off_mask_is_zero(x):
    return bool((x[MASK == 0] == 0).all())


def test_grpo_broadcasts_the_group_advantage_to_model_tokens_only():
    mask = MASK.repeat(2, 1)  # 4 samples, 2 prompts
    scores = torch.tensor([1.0, 0.0, 3.0, 1.0])
    group = torch.tensor([0, 0, 1, 1])
    adv = compute_advantages("grpo", mask=mask, scores=scores, group_index=group).advantages
    # group 0: mean 0.5, unbiased std sqrt(0.5); group 1: mean 2, std sqrt(2)
    want = [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), 1 / math.sqrt(2), -1 / math.sqrt(2)]
    for b in range(4):
        for t in range(6):
            expect = want[b] if mask[b, t] else 0.0
            assert float(adv[b, t]) == pytest.approx(expect, rel=1e-5, abs=1e-6), (b, t)


def test_rloo_leaves_one_out_on_model_tokens_only():
    mask = torch.cat([MASK, MASK[:1]])  # 3 samples of one prompt
    scores = torch.tensor([3.0, 0.0, 6.0])
    adv = compute_advantages(
        "rloo", mask=mask, scores=scores, group_index=torch.tensor([7, 7, 7])
    ).advantages
    want = [3 - (0 + 6) / 2, 0 - (3 + 6) / 2, 6 - (3 + 0) / 2]
    for b in range(3):
        for t in range(6):
            assert float(adv[b, t]) == pytest.approx(want[b] if mask[b, t] else 0.0)


def test_reinforce_pp_discounts_over_model_tokens_and_skips_observations():
    gamma = 0.9
    scores = torch.tensor([2.0, -1.0])
    res = compute_advantages("reinforce_pp", mask=MASK, scores=scores, gamma=gamma)
    # the score sits on the last model token; each earlier *model* token is one step back
    g = {
        (0, 4): 2.0,
        (0, 1): 2.0 * gamma,
        (0, 0): 2.0 * gamma**2,
        (1, 3): -1.0,
        (1, 2): -1.0 * gamma,
        (1, 0): -1.0 * gamma**2,
    }
    for (b, t), value in g.items():
        assert float(res.returns[b, t]) == pytest.approx(value, rel=1e-6)
    assert off_mask_is_zero(res.returns) and off_mask_is_zero(res.advantages)
    values = torch.tensor(list(g.values()), dtype=torch.float64)
    mean, std = values.mean(), values.std(unbiased=True)
    for (b, t), value in g.items():
        assert float(res.advantages[b, t]) == pytest.approx(
            float((value - mean) / math.sqrt(std**2 + 1e-8)), rel=1e-5
        )
    # the same returns as the response with its observations cut out (the recursion
    # jumps over them): the interior zeros change nothing but the positions
    packed = torch.tensor([[2.0 * gamma**2, 2.0 * gamma, 2.0]])
    r = torch.tensor([[0.0, 0.0, 2.0]])
    _, ret = reinforce_pp(r, torch.ones(1, 3), gamma=gamma)
    assert torch.allclose(ret.float(), packed)


def test_reinforce_pp_baseline_subtracts_the_group_mean_return():
    mask = torch.cat([MASK, MASK])
    scores = torch.tensor([2.0, -1.0, 0.0, 1.0])
    res = compute_advantages(
        "reinforce_pp_baseline",
        mask=mask,
        scores=scores,
        group_index=torch.tensor([0, 1, 0, 1]),
        gamma=1.0,
    )
    # gamma 1: every model token's return is its row's score; baselines 1.0 and 0.0
    centred = torch.zeros(4, 6, dtype=torch.float64)
    for b, base in enumerate([1.0, 0.0, 1.0, 0.0]):
        for t in VALID[b % 2]:
            centred[b, t] = scores[b] - base
    valid = mask.bool()
    x = centred[valid]
    want = (centred - x.mean()) / torch.sqrt(x.var(unbiased=True) + 1e-8)
    assert torch.allclose(res.advantages[valid].double(), want[valid], atol=1e-6)
    assert bool((res.advantages[~valid] == 0).all())


def test_gae_skips_observation_tokens_in_the_recursion():
    gamma, lam = 0.9, 0.8
    values = torch.tensor(
        [[0.5, 0.4, 9.0, 9.0, 0.3, 7.0], [0.2, 9.0, -0.1, 0.6, 7.0, 7.0]]
    )  # 9.0 on observations, 7.0 on padding: neither may leak in
    token_rewards = torch.tensor([[0.0, 0.0, 5.0, 5.0, 1.0, 5.0], [0.0, 5.0, 0.0, 2.0, 5.0, 5.0]])
    adv, ret = gae(token_rewards, values, MASK, gamma, lam, whiten=False)
    want_adv = torch.zeros(2, 6)
    for b, steps in enumerate(VALID):
        running, next_v = 0.0, 0.0
        for t in reversed(steps):  # only model tokens are time steps
            delta = float(token_rewards[b, t]) + gamma * next_v - float(values[b, t])
            running = delta + gamma * lam * running
            next_v = float(values[b, t])
            want_adv[b, t] = running
    assert torch.allclose(adv.float(), want_adv, atol=1e-6)
    want_ret = torch.where(MASK.bool(), want_adv + values, torch.zeros(()))
    assert torch.allclose(ret.float(), want_ret, atol=1e-6)
    # row 0 by hand: A4 = 1 - 0.3; A1 = 0.9*0.3 - 0.4 + 0.72*A4; A0 = 0.9*0.4 - 0.5 + 0.72*A1
    a4 = 1 - 0.3
    a1 = 0.9 * 0.3 - 0.4 + 0.72 * a4
    a0 = 0.9 * 0.4 - 0.5 + 0.72 * a1
    assert [float(adv[0, t]) for t in (0, 1, 4)] == pytest.approx([a0, a1, a4], abs=1e-6)
    # whitened: over the model tokens only
    white, _ = gae(token_rewards, values, MASK, gamma, lam, whiten=True)
    x = want_adv[MASK.bool()].double()
    want_white = (want_adv.double() - x.mean()) / torch.sqrt(x.var(unbiased=True) + 1e-8)
    assert torch.allclose(white[MASK.bool()].double(), want_white[MASK.bool()], atol=1e-5)
    assert off_mask_is_zero(white)


def test_gae_through_the_dispatch_puts_the_score_on_the_last_model_token():
    values = torch.zeros(2, 6)
    res = compute_advantages(
        "gae",
        mask=MASK,
        scores=torch.tensor([1.0, 2.0]),
        values=values,
        gamma=1.0,
        lam=1.0,
        whiten=False,
    )
    assert res.returns.tolist() == [
        [1.0, 1.0, 0.0, 0.0, 1.0, 0.0],
        [2.0, 0.0, 2.0, 2.0, 0.0, 0.0],
    ]


def test_kl_penalty_and_loss_aggregation_ignore_observations():
    kl = torch.full((2, 6), 0.5)
    token_rewards, stats = apply_kl_penalty(torch.tensor([1.0, 2.0]), kl, 0.1, MASK)
    assert token_rewards.tolist()[0] == pytest.approx([-0.05, -0.05, 0, 0, 0.95, 0])
    assert float(stats["kl"]) == pytest.approx(0.5)
    loss = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    # token-mean over the 6 model tokens: (0 + 1 + 4 + 6 + 8 + 9) / 6
    assert float(aggregate(loss, MASK, "token-mean")) == pytest.approx(28 / 6)
    # seq-mean-token-mean: row means (0+1+4)/3 and (6+8+9)/3
    assert float(aggregate(loss, MASK, "seq-mean-token-mean")) == pytest.approx(
        (5 / 3 + 23 / 3) / 2
    )

"""Aggregation, PPO clip / dual-clip, value loss, entropy and log-probs, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algos import (
    aggregate,
    entropy_bonus,
    entropy_from_logits,
    logprobs_from_logits,
    ppo_policy_loss,
    value_loss,
)
from hybridflow.errors import AlgorithmInputError

NAN = float("nan")

# ------------------------------------------------------------------ aggregation

LOSS = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, 50.0, 60.0, 70.0], [80.0, 90.0, 0.0, 1.0]])
LOSS_M = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # lengths 3, 1, 0


def test_each_aggregation_mode_by_hand():
    assert aggregate(LOSS, LOSS_M, "token-mean").item() == (1 + 2 + 3 + 4) / 4
    # per-sequence sums 6 and 4; the all-padding row is not a sequence
    assert aggregate(LOSS, LOSS_M, "seq-mean-token-sum").item() == (6 + 4) / 2
    # per-sequence means 2 and 4
    assert aggregate(LOSS, LOSS_M, "seq-mean-token-mean").item() == (2 + 4) / 2
    # an explicit divisor (global count across micro-batches)
    assert aggregate(LOSS, LOSS_M, "token-mean", denom=8).item() == 10 / 8
    assert aggregate(LOSS, LOSS_M, "seq-mean-token-mean", denom=4).item() == 6 / 4


def test_aggregation_with_global_denom_matches_the_whole_batch():
    torch.manual_seed(0)
    loss = torch.randn(4, 5)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    for mode, count in (("token-mean", mask.sum()), ("seq-mean-token-mean", 4)):
        whole = aggregate(loss, mask, mode)
        parts = aggregate(loss[:2], mask[:2], mode, denom=count) + aggregate(
            loss[2:], mask[2:], mode, denom=count
        )
        assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_aggregation_errors():
    with pytest.raises(AlgorithmInputError, match="no valid token"):
        aggregate(LOSS, torch.zeros_like(LOSS_M))
    with pytest.raises(AlgorithmInputError, match="unknown mode 'sum'"):
        aggregate(LOSS, LOSS_M, "sum")


# ------------------------------------------------------------------ PPO policy loss

# old_logprobs = 0, so ratio = exp(logprobs). Tokens (A, ratio), clip low 0.2 high 0.3:
#  a (+1, 1.10): inside the range           loss -1.10   grad -1.10
#  b (+1, 1.50): above 1.3, clipped         loss -1.30   grad 0
#  c (-1, 0.70): below 0.8, clipped         loss +0.80   grad 0
#  d (+1, 1.25): inside only because high=0.3 (symmetric 0.2 would clip it)
#  e (+1, 0.50): below range but pessimistic side, unclipped   loss -0.5  grad -0.5
#  f (-1, 4.00): exploded negative token: loss 4 (grad 4) / dual-clip c=3 -> 3 (grad 0)
RATIOS = torch.tensor([[1.1, 1.5, 0.7, 1.25], [0.5, 4.0, 1.0, 1.0]])
ADV = torch.tensor([[1.0, 1.0, -1.0, 1.0], [1.0, -1.0, 5.0, 5.0]])
PPO_M = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
PAD = ~PPO_M.bool()


def _ppo(**kw):
    lp = RATIOS.log().clone().requires_grad_(True)
    loss, stats = ppo_policy_loss(lp, torch.zeros(2, 4), ADV, PPO_M, **kw)
    loss.backward()
    return loss.item(), stats, lp.grad


def test_ppo_dual_clip_with_asymmetric_range():
    loss, stats, grad = _ppo(clip_ratio_low=0.2, clip_ratio_high=0.3, dual_clip_c=3.0)
    assert loss == pytest.approx((-1.1 - 1.3 + 0.8 - 1.25 - 0.5 + 3.0) / 6)
    assert stats["pg_clipfrac"].item() == pytest.approx(2 / 6)  # b, c
    assert stats["pg_clipfrac_lower"].item() == pytest.approx(1 / 6)  # f
    assert stats["ppo_kl"].item() == pytest.approx(-math.log(1.1 * 1.5 * 0.7 * 1.25 * 0.5 * 4) / 6)
    # d loss / d logprob = -A * ratio where unclipped, 0 where clipped; / 6 tokens
    expect = [[-1.1 / 6, 0, 0, -1.25 / 6], [-0.5 / 6, 0, 0, 0]]
    assert grad.tolist() == [pytest.approx(r, abs=1e-7) for r in expect]


def test_ppo_without_dual_clip_keeps_the_exploded_token():
    loss, stats, grad = _ppo(clip_ratio_low=0.2, clip_ratio_high=0.3)
    assert loss == pytest.approx((-1.1 - 1.3 + 0.8 - 1.25 - 0.5 + 4.0) / 6)
    assert stats["pg_clipfrac_lower"].item() == 0.0
    assert grad[1, 1].item() == pytest.approx(4.0 / 6)


def test_ppo_symmetric_range_clips_token_d():
    loss, stats, grad = _ppo(clip_ratio_low=0.2)  # high defaults to low
    # b is now clipped at 1.2 (not 1.3) and d at 1.2
    assert loss == pytest.approx((-1.1 - 1.2 + 0.8 - 1.2 - 0.5 + 4.0) / 6)
    assert stats["pg_clipfrac"].item() == pytest.approx(3 / 6)  # b, c, d
    assert grad[0, 3].item() == 0.0
    assert grad[0, 0].item() != 0.0


def test_ppo_aggregation_modes_are_passed_through():
    # per-token losses of the dual-clip case: row 0 (-1.1, -1.3, 0.8, -1.25), row 1 (-0.5, 3)
    kw = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3, "dual_clip_c": 3.0}
    lp = RATIOS.log()
    seq_sum = ppo_policy_loss(lp, torch.zeros(2, 4), ADV, PPO_M, agg="seq-mean-token-sum", **kw)
    assert seq_sum[0].item() == pytest.approx((-2.85 + 2.5) / 2)
    seq_mean = ppo_policy_loss(lp, torch.zeros(2, 4), ADV, PPO_M, agg="seq-mean-token-mean", **kw)
    assert seq_mean[0].item() == pytest.approx((-2.85 / 4 + 2.5 / 2) / 2)


def test_ppo_padding_garbage_changes_no_loss_stat_or_gradient():
    base_loss, base_stats, base_grad = _ppo(
        clip_ratio_low=0.2, clip_ratio_high=0.3, dual_clip_c=3.0
    )
    lp = RATIOS.log().masked_fill(PAD, NAN).requires_grad_(True)
    loss, stats = ppo_policy_loss(
        lp,
        torch.zeros(2, 4).masked_fill(PAD, float("inf")),
        ADV.masked_fill(PAD, 1e30),
        PPO_M,
        0.2,
        0.3,
        3.0,
    )
    loss.backward()
    assert loss.item() == base_loss
    assert {k: v.item() for k, v in stats.items()} == {k: v.item() for k, v in base_stats.items()}
    assert torch.equal(lp.grad, base_grad)


def test_ppo_input_validation():
    lp = RATIOS.log()
    with pytest.raises(AlgorithmInputError, match="dual_clip_c"):
        ppo_policy_loss(lp, lp, ADV, PPO_M, dual_clip_c=0.9)
    with pytest.raises(AlgorithmInputError, match="clip_ratio_low"):
        ppo_policy_loss(lp, lp, ADV, PPO_M, clip_ratio_low=1.0)
    with pytest.raises(AlgorithmInputError, match="advantages"):
        ppo_policy_loss(lp, lp, ADV[:, :3], PPO_M)


# ------------------------------------------------------------------ value loss

# clip 0.2 around old values; returns R:
#  a: old 1.0 v 1.1 R 2: both terms 0.81                        grad (v - R) = -0.9
#  b: old 1.0 v 1.5 R 2: unclipped 0.25, clipped (1.2) 0.64 -> binding, grad 0
#  c: old 1.0 v 1.5 R 0: unclipped 2.25, clipped 1.44 -> unclipped, grad 1.5
#  d: old 0.0 v -0.5 R 1: unclipped 2.25, clipped (-0.2) 1.44 -> unclipped, grad -1.5
V = torch.tensor([[1.1, 1.5, 1.5, -0.5, NAN]])
V_OLD = torch.tensor([[1.0, 1.0, 1.0, 0.0, NAN]])
RET = torch.tensor([[2.0, 2.0, 0.0, 1.0, NAN]])
V_M = torch.tensor([[1, 1, 1, 1, 0]])


def test_value_loss_clipped_by_hand():
    v = V.clone().requires_grad_(True)
    loss, stats = value_loss(v, V_OLD, RET, V_M, clip_range=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.81 + 0.64 + 2.25 + 2.25) / 4)
    assert stats["vf_clipfrac"].item() == pytest.approx(1 / 4)
    loss.backward()
    # d(0.5 * mean((v - R)^2)) / dv = (v - R) / 4 where unclipped
    assert v.grad.tolist() == [pytest.approx([-0.9 / 4, 0.0, 1.5 / 4, -1.5 / 4, 0.0])]


def test_value_loss_unclipped():
    loss, stats = value_loss(V, V_OLD, RET, V_M, clip_range=None)
    assert loss.item() == pytest.approx(0.5 * (0.81 + 0.25 + 2.25 + 2.25) / 4)
    assert stats["vf_clipfrac"].item() == 0.0


# ------------------------------------------------------------------ entropy / log-probs

LN3 = math.log(3)


def test_entropy_by_hand_and_stable_for_huge_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, LN3, -1e4, -1e4], [1e4, 1e4, -1e4, -1e4]]])
    h = entropy_from_logits(logits)
    # uniform over 4: ln 4 ; p = (1/4, 3/4): -(1/4 ln 1/4 + 3/4 ln 3/4) ; two equal huge: ln 2
    expect = [math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2)]
    assert h.tolist() == [pytest.approx(expect, abs=1e-5)]
    assert torch.equal(entropy_from_logits(logits, chunk_size=1), h)
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32


def test_entropy_bonus_sign_value_and_gradient():
    logits = torch.tensor([[[0.0, LN3], [0.0, 0.0]]], requires_grad=True)
    ent = entropy_from_logits(logits)
    term, stats = entropy_bonus(ent, torch.tensor([[1, 0]]), coef=0.01)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert term.item() == pytest.approx(-0.01 * h)
    assert stats["entropy"].item() == pytest.approx(h)
    term.backward()
    # minimising -H pushes the (1/4, 3/4) distribution toward uniform: raise logit 0
    assert logits.grad[0, 0, 0] < 0 < logits.grad[0, 0, 1]
    assert logits.grad[0, 1].abs().sum() == 0  # masked position gets no gradient


def test_logprobs_by_hand_masked_chunked_and_gradient():
    logits = torch.tensor(
        [[[0.0, LN3, -1e4], [0.0, 0.0, 0.0]], [[1000.0, 0.0, 0.0], [5.0, 5.0, 5.0]]],
        requires_grad=True,
    )
    tokens = torch.tensor([[1, 2], [1, -100]])
    mask = torch.tensor([[1, 1], [1, 0]])
    lp = logprobs_from_logits(logits, tokens, mask)
    expect = [[math.log(0.75), -math.log(3)], [-1000.0, 0.0]]
    assert lp.tolist() == [pytest.approx(r, abs=1e-5) for r in expect]
    assert torch.equal(logprobs_from_logits(logits, tokens, mask, chunk_size=1), lp)
    lp[0, 0].backward()
    # d log p_1 / d logits = onehot(1) - softmax = (-1/4, 1/4, 0)
    assert logits.grad[0, 0].tolist() == pytest.approx([-0.25, 0.25, 0.0], abs=1e-6)
    assert logprobs_from_logits(logits.detach().bfloat16(), tokens, mask).dtype == torch.float32


def test_logprobs_bad_tokens_are_clear_errors():
    logits = torch.zeros(1, 2, 3)
    with pytest.raises(AlgorithmInputError, match=r"\[0, 3\)"):
        logprobs_from_logits(logits, torch.tensor([[0, 3]]))
    with pytest.raises(AlgorithmInputError, match=r"\[0, 3\)"):
        logprobs_from_logits(logits, torch.tensor([[0, -100]]))  # -100 without a mask
    with pytest.raises(AlgorithmInputError, match="tokens"):
        logprobs_from_logits(logits, torch.tensor([[0, 1, 2]]))


def test_option_dataclasses_take_their_value_lists_from_the_algos():
    """AGG_MODES, POLICY_LOSSES and CORRECTION_MODES are the lists the actor's and the
    trainer's options accept (one table each: the Literal aliases in hybridflow.algos)."""
    import typing

    from hybridflow.algos import AGG_MODES, CORRECTION_MODES, POLICY_LOSSES
    from hybridflow.stages.actor import ActorOptions
    from hybridflow.stages.trainer import TrainOptions

    actor = typing.get_type_hints(ActorOptions)
    assert typing.get_args(actor["loss_agg_mode"]) == AGG_MODES
    assert typing.get_args(actor["policy_loss"]) == POLICY_LOSSES
    modes = typing.get_args(actor["rollout_correction"])
    assert typing.get_args(modes[0]) == CORRECTION_MODES and modes[1] is type(None)
    trainer = typing.get_args(typing.get_type_hints(TrainOptions)["loss_agg_mode"])
    assert trainer == AGG_MODES[:3]  # the critic cannot take the fixed-length mode

"""Masked statistics on hand-computed values; padding (even NaN/inf) never leaks."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algos import masked_mean, masked_sum, masked_var, masked_whiten, place_on_last_token
from hybridflow.errors import AlgorithmInputError

NAN, INF = float("nan"), float("inf")

# Valid values 1, 2, 3 | 4, 5; the last positions are padding.
X = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 200.0, 300.0]])
M = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
X_GARBAGE = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, 5.0, INF, -1e30]])


def test_sum_and_mean_by_hand():
    assert masked_sum(X, M).item() == 15.0
    assert masked_mean(X, M).item() == 3.0
    assert masked_sum(X, M, dim=-1).tolist() == [6.0, 9.0]
    assert masked_mean(X, M, dim=-1).tolist() == [2.0, 4.5]
    assert masked_mean(X, M, dim=-1, keepdim=True).shape == (2, 1)
    # bool masks and float masks mean the same thing
    assert masked_mean(X, M.bool()).item() == masked_mean(X, M.float()).item() == 3.0


def test_var_by_hand():
    # 1..5: mean 3, squared deviations 4 + 1 + 0 + 1 + 4 = 10
    assert masked_var(X, M).item() == pytest.approx(10 / 4)
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(10 / 5)
    # rows: [1, 2, 3] -> (1 + 0 + 1) / 2 = 1 ; [4, 5] -> (0.25 + 0.25) / 1 = 0.5
    assert masked_var(X, M, dim=-1).tolist() == pytest.approx([1.0, 0.5])
    assert masked_var(X, M, dim=-1, unbiased=False).tolist() == pytest.approx([2 / 3, 0.25])


def test_whiten_by_hand():
    s = math.sqrt(2.5)
    out = masked_whiten(X, M)
    expect = [[-2 / s, -1 / s, 0.0, 0.0], [1 / s, 2 / s, 0.0, 0.0]]
    assert out.tolist() == [pytest.approx(r, abs=1e-6) for r in expect]
    kept = masked_whiten(X, M, shift_mean=False)
    expect_kept = [[-2 / s + 3, -1 / s + 3, 3.0, 0.0], [1 / s + 3, 2 / s + 3, 0.0, 0.0]]
    assert kept.tolist() == [pytest.approx(r, abs=1e-6) for r in expect_kept]


def test_garbage_in_padding_changes_nothing_including_gradients():
    for fn in (masked_sum, masked_mean, masked_var):
        assert torch.equal(fn(X, M), fn(X_GARBAGE, M))
        assert torch.equal(fn(X, M, dim=-1), fn(X_GARBAGE, M, dim=-1))
    assert torch.equal(masked_whiten(X, M), masked_whiten(X_GARBAGE, M))
    x = X_GARBAGE.clone().requires_grad_(True)
    (masked_whiten(x, M) * torch.arange(8.0).view(2, 4)).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert x.grad[~M.bool()].abs().sum() == 0
    assert x.grad[M.bool()].abs().sum() > 0


def test_empty_masks_raise_or_give_the_declared_value():
    zeros = torch.zeros_like(M)
    with pytest.raises(AlgorithmInputError, match="no valid element"):
        masked_mean(X, zeros)
    row_empty = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(AlgorithmInputError):
        masked_mean(X, row_empty, dim=-1)
    assert masked_mean(X, row_empty, dim=-1, empty=0.0).tolist() == [1.5, 0.0]
    assert masked_sum(X, zeros).item() == 0.0  # an empty sum is 0 by definition
    one = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(AlgorithmInputError, match="fewer than 2"):
        masked_var(X, one)  # unbiased variance of one element is undefined
    assert masked_var(X, one, unbiased=False).item() == 0.0
    with pytest.raises(AlgorithmInputError):
        masked_whiten(X, one)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(AlgorithmInputError, match=r"masked_mean|masked_sum"):
        masked_mean(X, M[:, :3])


def test_place_on_last_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 0]])
    out = place_on_last_token(torch.tensor([5.0, 6.0, 7.0]), mask)
    assert out.tolist() == [[0.0, 5.0, 0.0], [0.0, 0.0, 6.0], [0.0, 7.0, 0.0]]
    with pytest.raises(AlgorithmInputError, match=r"rows \[1\]"):
        place_on_last_token(torch.tensor([1.0, 2.0]), torch.tensor([[1, 0], [0, 0]]))

"""The `val/` metrics (pipeline/observe/validation.py) and the validation schedule, from
hand-computed cases."""

from __future__ import annotations

import math

import pytest

from hybridflow.config.schema import ValidationConfig
from hybridflow.pipeline.observe.validation import (
    ValSample,
    is_validation_row,
    validation_metrics,
)
from hybridflow.pipeline.runtime.jobs.validation import Validator


def _s(prompt, source, reward, pred, length=4):
    return ValSample(prompt, source, reward, length, {"acc": reward, "pred": pred})


def test_mean_best_and_majority_at_n():
    samples = [
        # prompt 0: answers 5, 5, 7 -> majority 5 (right): acc 2/3, best 1, maj 1
        _s(0, "gsm8k", 1.0, "5"),
        _s(0, "gsm8k", 1.0, "5"),
        _s(0, "gsm8k", 0.0, "7"),
        # prompt 1: answers 3, 4, 4 -> majority 4 (wrong): acc 1/3, best 1, maj 0
        _s(1, "gsm8k", 1.0, "3"),
        _s(1, "gsm8k", 0.0, "4"),
        _s(1, "gsm8k", 0.0, "4"),
        # another data source, one prompt: all wrong
        _s(2, "math", 0.0, "x", length=10),
        _s(2, "math", 0.0, "y", length=10),
        _s(2, "math", 0.0, "x", length=10),
    ]
    m = validation_metrics(samples, n=3)
    assert m["val/reward/mean"] == pytest.approx(3 / 9)
    assert m["val/response_length/mean"] == pytest.approx((6 * 4 + 3 * 10) / 9)
    assert m["val/gsm8k/reward/mean"] == pytest.approx(0.5)
    assert m["val/gsm8k/acc/mean@3"] == pytest.approx(0.5)
    assert m["val/gsm8k/acc/best@3"] == pytest.approx(1.0)
    assert m["val/gsm8k/acc/maj@3"] == pytest.approx(0.5)
    assert m["val/math/acc/best@3"] == 0.0 and m["val/math/acc/maj@3"] == 0.0
    assert is_validation_row(m) and not is_validation_row({"reward/mean": 1.0, **m})


def test_a_majority_tie_goes_to_the_answer_seen_first():
    samples = [_s(0, "d", 0.0, "1"), _s(0, "d", 1.0, "2"), _s(0, "d", 0.0, "1")][:2]
    m = validation_metrics(samples, n=2)
    assert m["val/d/acc/maj@2"] == 0.0  # "1" (wrong) and "2" tie; "1" came first


def test_n_1_reports_means_only_and_no_pred_means_no_majority():
    samples = [ValSample(0, "d", 0.5, 3, {"acc": 1.0}), ValSample(1, "d", 0.0, 5, {})]
    m = validation_metrics(samples, n=1)
    assert m["val/d/reward/mean"] == 0.25 and m["val/d/acc/mean"] == 1.0
    assert not any("@" in k for k in m)
    m2 = validation_metrics([ValSample(0, "", 1.0, 1, {}), ValSample(0, "", 0.0, 1, {})], n=2)
    assert "val/unknown/reward/maj@2" not in m2 and m2["val/unknown/reward/best@2"] == 1.0
    assert validation_metrics([], n=1) == {}
    assert math.isnan(
        validation_metrics([ValSample(0, "d", 1.0, 1, {"acc": "x"})], 1).get(
            "val/d/acc/mean", math.nan
        )
    )


@pytest.mark.parametrize(
    ("cfg", "start", "end", "points"),
    [
        (dict(interval=10), 0, 30, [0, 10, 20, 30]),
        (dict(interval=10), 0, 25, [0, 10, 20, 25]),
        (dict(interval=10, before_train=False, after_train=False), 0, 25, [10, 20]),
        (dict(interval=10), 13, 30, [13, 20, 30]),  # resumed at 13
        (dict(interval=0), 0, 5, [0, 5]),
        (dict(interval=0, before_train=False), 0, 5, [5]),
        (dict(interval=1, after_train=False), 0, 3, [0, 1, 2, 3]),
    ],
)
def test_the_validation_points(cfg, start, end, points):
    v = Validator.__new__(Validator)  # points() reads the config alone
    v.cfg = ValidationConfig(source="x", **cfg)
    assert v.points(start, end) == points

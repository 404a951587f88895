"""The validation loop from the Python API: `train(validation=...)` and `validate()`.

Validation runs between training jobs on the same processes; it must not change what
training does (the same seeded run with and without it logs the same training rows) and
the same policy evaluated twice gives the same scores."""

from __future__ import annotations

import json

import pytest
from engine_job import builder

pytestmark = pytest.mark.slow

# Wall-clock numbers differ run to run; everything else must not.
TIMING = ("timing/", "compute/", "perf/", "rollout/gen_s", "rollout/tokens_per_s", "reward/fn_s")
VALIDATION = {"source": "last_digit", "max_prompts": 12, "interval": 2, "generations": 1}


def _clean(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def test_validation_leaves_training_alone_and_repeats_itself(tmp_path):
    with builder().build(metrics_backend="jsonl", log_dir=tmp_path / "plain") as engine:
        plain = engine.train("last_digit", steps=3)
    with builder().build(metrics_backend="jsonl", log_dir=tmp_path / "val") as engine:
        result = engine.train("last_digit", steps=3, validation=VALIDATION)
        again = engine.validate()  # the same source and settings, the final policy
        other = engine.validate("last_digit", max_prompts=4)

    assert _clean(result.metrics) == _clean(plain.metrics)
    assert [r["step"] for r in result.validation] == [0, 2, 3]
    last = result.validation[-1]
    for key in ("val/reward/mean", "val/unknown/reward/mean", "val/response_length/mean"):
        assert again[key] == pytest.approx(last[key]), key
    assert "val/reward/mean" in other
    rows = [json.loads(x) for x in (tmp_path / "val" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val/reward/mean" in r] == [0, 2, 3]
    gens = (tmp_path / "val" / "val_generations.jsonl").read_text().splitlines()
    assert [json.loads(g)["step"] for g in gens] == [0, 2, 3, 3, 3]

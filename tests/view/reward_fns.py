"""The reward the viewer's runs name (`tests.view.reward_fns:digit_match`, imported by the
reward stage process: the launcher puts the repo root on its PYTHONPATH)."""

from __future__ import annotations


def digit_match(data_source, solution_str, ground_truth, extra_info=None):
    """verl's per-sample signature: 1 for the right digit first, 0.1 for another digit;
    `acc` and `pred` travel per sample in reward_info (samples.jsonl shows them)."""
    pred = solution_str.strip()[:1]
    acc = float(pred == str(ground_truth))
    return {"score": max(acc, 0.1 * pred.isdigit()), "acc": acc, "pred": pred}

"""Reward functions the end-to-end tests name in their topologies (imported by the reward
stage process as `tests.e2e.reward_fns:<name>`; the launcher puts the repo root on the
child's PYTHONPATH)."""

from __future__ import annotations


def always_one(prompts, responses, prompt_ids, response_ids, metadata):
    """1.0 for every sample: the critic's targets are known, so its loss must fall."""
    return [1.0] * len(responses)


def fails_on_a_seven(prompts, responses, prompt_ids, response_ids, metadata):
    """Raises for any sample whose prompt holds a 7 (a buggy user function)."""
    for p in prompts:
        if "7" in p:
            raise ValueError(f"cannot score prompt {p!r}")
    return [0.0] * len(responses)


def verl_last_digit(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature on the verl-format fixture: the nested record fields must arrive
    intact (a KeyError here fails the run), the reward is exact-match with a `pred`."""
    assert extra_info["nested"] == {"tags": ["a", "b"], "depth": {"k": 1}}, extra_info
    assert data_source == "test/last_digit", data_source
    pred = solution_str.strip()[:1]
    acc = float(pred == ground_truth)
    return {"score": acc, "acc": acc, "pred": pred, "digit": float(pred.isdigit())}

"""The training layout of a multi-turn trajectory: token continuity, masks that are zero
on observations, log-probs on model tokens only, and the padded micro-batch tensors."""

from __future__ import annotations

import itertools

import pytest
import torch

from hybridflow.stages.env.layout import Trajectory, assemble, collate

PROMPT = [2, 40, 41]
GEN = [[10, 11, 1], [12, 1], [13, 14, 15, 1]]
OBS = [[50, 51, 52], [53]]
LOGP = [[-0.1, -0.2, -0.3], [-0.4, -0.5], [-0.6, -0.7, -0.8, -0.9]]


def test_token_continuity_against_a_hand_built_reference():
    layout = assemble(PROMPT, GEN, OBS, LOGP)
    assert layout.response_ids == [10, 11, 1, 50, 51, 52, 12, 1, 53, 13, 14, 15, 1]
    assert layout.num_turns == 3


def test_masks_are_zero_exactly_on_observations():
    layout = assemble(PROMPT, GEN, OBS, LOGP)
    assert layout.response_mask == [1, 1, 1, 0, 0, 0, 1, 1, 0, 1, 1, 1, 1]
    observed = [t for t, m in zip(layout.response_ids, layout.response_mask, strict=True) if not m]
    assert observed == [50, 51, 52, 53]
    assert layout.observation_tokens == 4


def test_logprobs_sit_on_model_tokens_and_zero_on_observations():
    layout = assemble(PROMPT, GEN, OBS, LOGP)
    assert layout.rollout_logprobs == pytest.approx(
        [-0.1, -0.2, -0.3, 0, 0, 0, -0.4, -0.5, 0, -0.6, -0.7, -0.8, -0.9]
    )


def test_each_turns_context_extends_the_last_exactly():
    traj = Trajectory(PROMPT)
    contexts = [traj.context_ids()]
    for k, gen in enumerate(GEN):
        traj.add_turn(gen, LOGP[k])
        if k < len(OBS):
            traj.add_observation(OBS[k])
        contexts.append(traj.context_ids())
    for before, after in itertools.pairwise(contexts):
        assert after[: len(before)] == before
    assert contexts[-1] == [*PROMPT, *assemble(PROMPT, GEN, OBS).response_ids]
    assert traj.total_tokens == len(contexts[-1])


def test_a_trailing_observation_is_dropped():
    traj = Trajectory(PROMPT)
    traj.add_turn([10, 1])
    traj.add_observation([50, 51])  # e.g. the loop stopped at max_total_tokens
    layout = traj.layout()
    assert layout.response_ids == [10, 1] and layout.response_mask == [1, 1]
    assert traj.context_ids()[-2:] == [50, 51]  # the running context is untouched


def test_missing_logprobs_are_zero_and_mismatches_are_refused():
    layout = assemble(PROMPT, [[10, 11]], [])
    assert layout.rollout_logprobs == [0.0, 0.0]
    with pytest.raises(ValueError, match="2 tokens came with 1 log-probs"):
        Trajectory(PROMPT).add_turn([10, 11], [-0.1])
    with pytest.raises(ValueError, match="3 turns take 2 observations"):
        assemble(PROMPT, GEN, OBS[:1])
    with pytest.raises(ValueError, match="3 turns came with 2 log-prob lists"):
        assemble(PROMPT, GEN, OBS, LOGP[:2])


def test_collate_pads_on_the_right():
    long = assemble(PROMPT, GEN, OBS, LOGP)
    short = assemble(PROMPT, [[7, 1]], [], [[-1.0, -2.0]])
    batch = collate([long, short], pad_id=0)
    width = len(long.response_ids)
    assert batch["response_ids"].shape == (2, width)
    assert batch["response_ids"].dtype == torch.int64
    assert batch["response_mask"].dtype == torch.int64
    assert batch["rollout_logprobs"].dtype == torch.float32
    assert batch["response_ids"][0].tolist() == long.response_ids
    assert batch["response_ids"][1].tolist() == [7, 1] + [0] * (width - 2)
    assert batch["response_mask"][0].tolist() == long.response_mask
    assert batch["response_mask"][1].tolist() == [1, 1] + [0] * (width - 2)
    assert batch["rollout_logprobs"][1].tolist() == pytest.approx(
        [-1.0, -2.0] + [0.0] * (width - 2)
    )
    assert batch["num_turns"].tolist() == [3, 1]

"""The `env` reward backend: the environment's reward, checked, as the run's `rewards`."""

from __future__ import annotations

import pytest
import torch

from hybridflow.errors import BatchError, RewardFunctionError
from hybridflow.stages.reward.env import EnvReward


def test_env_reward_backend_passes_the_checked_rewards():
    role = EnvReward()
    role.setup(None)
    env_reward = torch.tensor([1.0, 0.0, 0.25])
    out, metrics = role.handle("score", {"env_reward": env_reward}, {})
    assert torch.equal(out["rewards"], env_reward) and out["rewards"].dtype == torch.float32
    assert metrics["reward/env_mean"] == pytest.approx(1.25 / 3)
    with pytest.raises(RewardFunctionError, match="env_reward of sample 1"):
        role.handle("score", {"env_reward": torch.tensor([0.0, float("nan")])}, {})
    with pytest.raises(BatchError, match="lacks env_reward"):
        role.handle("score", {"rewards": torch.zeros(2)}, {})

"""The `env` reward backend: a multi-turn rollout's environment reward as the run's reward.

  score   env_reward [B] float32 (the rollout's generate output: the sum of each
          trajectory's step rewards, stages/rollout/multiturn.py)
      ->  rewards [B] float32, the same values after the one value check every reward
          backend's values pass (hybridflow.reward.values)

Why a reward role and not a rename in the coordinator: everything downstream that
reads a reward keys on a reward role's `score` op and its `rewards`: the advantages
driver op, dynamic sampling, and validation (which cuts the dataflow down to the
reward-kind roles' score ops and what feeds them), so the environment's reward enters
training and validation the way every other reward does, and its metrics read the same.
It holds no model: colocate it in the rollout's stage (`roles: {reward: {backend: env}}`
beside the rollout), where it costs one tiny task per micro-batch.

    - role: rollout
      op: generate
      inputs: [prompt_ids, prompt_mask, metadata_json]
      outputs: [response_ids, response_mask, rollout_logprobs, env_reward, num_turns]
    - role: reward
      op: score
      inputs: [env_reward]
      outputs: [rewards]

Metrics: reward/env_mean. Invariant: `rewards` equals `env_reward` (float32) row for row.
"""

from __future__ import annotations

import torch

from hybridflow.errors import BatchError, RewardFunctionError
from hybridflow.reward.values import BadReward, reward_list
from hybridflow.stages.base import Batch, Metrics, Params, StageContext
from hybridflow.stages.contract import RoleBase, op


class EnvReward(RoleBase):
    """Registered as ("reward", "env")."""

    def setup(self, ctx: StageContext) -> None:
        """Nothing to build: the values come checked from the rollout's environment."""

    @op(inputs=("env_reward",), outputs=("rewards",))
    def score(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """The environment's reward of each trajectory, checked, as `rewards`."""
        values = batch.get("env_reward")
        if values is None:
            raise BatchError(
                f"env reward score: the batch lacks env_reward (it has {sorted(batch)}); "
                "list it among the rollout generate op's outputs and this op's inputs"
            )
        if values.dim() != 1:
            raise BatchError(f"env reward score: env_reward must be [B], got {tuple(values.shape)}")
        try:
            checked = reward_list(values, values.shape[0])
        except BadReward as exc:
            raise RewardFunctionError(
                f"env reward score: env_reward of sample {exc.index}: {exc}",
                function="env_reward",
                sample=exc.index,
            ) from None
        rewards = torch.tensor(checked, dtype=torch.float32)  # [B]
        return {"rewards": rewards}, {"reward/env_mean": float(rewards.mean())}

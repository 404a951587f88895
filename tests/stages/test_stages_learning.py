"""The roles together, in process (no pipeline): a short seeded GRPO loop must learn.

rollout.generate -> reward.score -> GRPO advantages -> actor.update -> optimizer_step ->
actor.reshard (colocated), on the built-in `last_digit` task from a random-init tiny
model. What it learns in 15 steps is the answer's format (a digit, then stop): the
reward goes from ~0.02 to ~0.3. Also: every backend of this package is registered.
"""

from __future__ import annotations

from stage_helpers import make_role

from hybridflow.algos.advantages import grpo_advantages
from hybridflow.pipeline.sources.prompt_source import PromptSource
from hybridflow.stages import create_role
from hybridflow.stages.actor import Actor
from hybridflow.stages.base import Role
from hybridflow.stages.reward.function import FunctionReward
from hybridflow.stages.rollout.hf import HFRollout


def test_registered_backends_are_roles():
    for kind, backend in [
        ("rollout", "hf"),
        ("actor", "hf"),
        ("critic", "hf"),
        ("reference", "hf"),
        ("reward", "function"),
        ("reward", "model"),
    ]:
        assert isinstance(create_role(kind, backend), Role)


def test_short_grpo_loop_raises_the_reward():
    rollout = make_role(HFRollout, "rollout", {"model": "tiny", "n": 8, "max_new_tokens": 3})
    actor = make_role(Actor, "actor", {"model": "tiny", "lr": 1e-2}, colocated={"rollout": rollout})
    reward = make_role(
        FunctionReward,
        "reward",
        {"function": "hybridflow.data.tasks:last_digit_reward", "tokenizer": "builtin"},
    )
    source = PromptSource(
        ("prompt_ids", "prompt_mask", "metadata_json"),
        {"source": "task:last_digit", "tokenizer": "builtin", "task_size": 256},
        seed=0,
    )
    history = []
    for step in range(15):
        prompts = source.batch(step, 8)
        out, _ = rollout.handle("generate", prompts, {"step": step, "mb_id": 0})
        meta = prompts["metadata_json"][out["group_index"]]  # per sample
        rewards = reward.handle("score", {**out, "metadata_json": meta}, {})[0]["rewards"]
        adv = grpo_advantages(rewards, out["group_index"], out["response_mask"])
        actor.handle("update", {**out, "advantages": adv}, {})
        actor.handle("optimizer_step", {}, {})
        actor.handle("reshard", {}, {})
        history.append(float(rewards.mean()))
    first, last = sum(history[:3]) / 3, sum(history[-3:]) / 3
    assert first < 0.1 and last > 3 * first + 0.1, history
    assert rollout.policy_version == 15

"""Minimal PPO: an actor and a reward function, nothing else (runs on CPU in seconds).

The policy is a tiny random-init Qwen2-shaped model; the reward is the exact rule of the
built-in `last_digit` task ("last:40719=" -> "9"). Without a critic, `ppo_loss` takes
REINFORCE++ advantages (whitened discounted returns); the sampler's log-probs are the
"old" policy of the PPO ratio (hybrid engine: same weights).

    python examples/minimal_ppo.py [--steps 8] [--log-dir runs/minimal_ppo]

Prints the reward per step, then one more training step on a few prompts of its own
(`engine.run`: the declared outputs, here the trained policy's responses and their
rewards); metrics land in <log-dir>/metrics.jsonl.
"""

from __future__ import annotations

import argparse

from hybridflow import DataflowBuilder

PROMPTS = ["last:40719=", "last:582=", "last:1234=", "last:90817="]

LOGIC = """
response = actor.generate(prompt)
reward_score = reward.score(prompt, response)
loss = ppo_loss(reward_score)
actor.update(loss)
"""


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--log-dir", default="runs/minimal_ppo")
    args = ap.parse_args(argv)

    df = DataflowBuilder("minimal_ppo", seed=0)
    df.add_actor(model_name="tiny", device_mapping="cpu", lr=1e-2, max_new_tokens=3)
    # Same mapping as the actor: one process hosts everything (the smallest footprint).
    df.add_reward_function("hybridflow.data.tasks:last_digit_reward", device_mapping="cpu")
    outputs = ["loss", "rewards", "response"]
    df.define_training_step(inputs=["prompt"], outputs=outputs, logic=LOGIC)
    df.configure(step_batch=32, micro_batch=16)
    engine = df.build(log_level="WARNING", metrics_backend="jsonl", log_dir=args.log_dir)

    result = engine.train("last_digit", steps=args.steps)
    for step, (reward, loss) in enumerate(
        zip(result.outputs["rewards"], result.outputs["loss"], strict=True)
    ):
        print(f"step {step:3d}  reward/mean {reward:.3f}  actor/pg_loss {loss:+.2e}")
    # One more step on these prompts (the logic updates the actor, so `run` trains):
    # the trained policy's responses, their rewards (one row per prompt) and the loss.
    results = engine.run(PROMPTS)
    for prompt, response, reward in zip(
        PROMPTS, results["response"], results["rewards"].tolist(), strict=True
    ):
        print(f"{prompt!r:16} -> {response!r:10} reward {reward:.2f}")
    print(f"run step: actor/pg_loss {results['loss'].item():+.2e}")
    print(f"metrics: {result.run_dir}/metrics.jsonl  checkpoint: {engine.state}")
    return result.outputs


if __name__ == "__main__":
    main()

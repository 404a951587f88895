"""The small GRPO job of the engine tests (imported by the tests and by the subprocess
that gets SIGKILLed mid-run)."""

from __future__ import annotations

import sys

from hybridflow import DataflowBuilder

LOGIC = """
response = actor.generate(prompt, n=4)
reward_score = reward.score(prompt, response)
ref_logprob = ref.get_logprob(prompt, response)
actor_logprob = actor.get_logprob(prompt, response)
kl_div = kl(actor_logprob, ref_logprob, kind="k3")
loss = grpo_loss(reward_score, kl_div)
actor.update(loss)
"""


def builder(seed: int = 3) -> DataflowBuilder:
    df = DataflowBuilder("resume", seed=seed)
    df.add_actor("tiny", device_mapping="cpu", lr=1e-2, max_new_tokens=3)
    df.add_reference_model("tiny")
    df.add_reward_function("hybridflow.data.tasks:last_digit_reward")
    df.define_training_step(["prompt"], ["loss", "kl_div", "rewards"], LOGIC)
    df.configure(step_batch=16, micro_batch=8)
    return df


if __name__ == "__main__":  # python engine_job.py LOG_DIR SAVE_PATH STEPS LOG_LEVEL
    log_dir, save_path, steps, level = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    engine = builder().build(log_level=level, metrics_backend="jsonl", log_dir=log_dir)
    engine.save_checkpoint(save_path, save_interval=1, keep_last=10)
    engine.train("last_digit", steps=steps)

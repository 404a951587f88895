"""SFT, then RL: supervised fine-tuning on a synthetic task, then GRPO improves it.

Phase 1 (SFT): the actor learns from the `last_digit` task's ideal answers
("last:40719=" -> "9", then EOS) with `engine.sft`, a pipeline run whose step is
actor.sft_update per micro-batch + optimizer step. The fine-tuned policy is exported
(save_pretrained) and replaces the initial model everywhere (actor, rollout, reference).
Phase 2 (RL): GRPO with a KL loss to the SFT reference on the task's exact rule reward.

    python examples/sft_rlhf_pipeline.py [--sft-steps 4] [--rl-steps 8] [--log-dir ...]

Both phases' metrics are printed (SFT loss per step, then reward per step) with the
mean reward of the first and last RL steps.
"""

from __future__ import annotations

import argparse

from hybridflow import DataflowBuilder

LOGIC = """
response = actor.generate(prompt, n=8)
reward_score = reward.score(prompt, response)
ref_logprob = ref.get_logprob(prompt, response)
actor_logprob = actor.get_logprob(prompt, response)
kl_div = kl(actor_logprob, ref_logprob, kind="k3")
loss = grpo_loss(reward_score, kl_div, kl_coef=0.01)
actor.update(loss)
"""


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sft-steps", type=int, default=4)
    ap.add_argument("--rl-steps", type=int, default=8)
    ap.add_argument("--log-dir", default="runs/sft_rlhf")
    args = ap.parse_args(argv)

    df = DataflowBuilder("sft_rlhf", seed=0)
    df.add_actor(model_name="tiny", device_mapping="cpu", lr=1e-2, max_new_tokens=3)
    df.add_reference_model(model_name="tiny")
    df.add_reward_function("hybridflow.data.tasks:last_digit_reward", device_mapping="cpu")
    df.define_training_step(inputs=["prompt"], outputs=["loss", "kl_div", "rewards"], logic=LOGIC)
    df.configure(step_batch=32, micro_batch=16)
    engine = df.build(log_level="WARNING", metrics_backend="jsonl", log_dir=args.log_dir)

    sft = engine.sft("last_digit", steps=args.sft_steps, batch_size=32)
    print("phase 1: SFT on last_digit")
    for step, row in enumerate(sft.metrics):
        print(f"  sft step {step:3d}  actor/sft_loss {row['actor/sft_loss']:.4f}")
    rl = engine.train("last_digit", steps=args.rl_steps)
    print("phase 2: GRPO from the SFT policy")
    for step, (reward, kl) in enumerate(
        zip(rl.outputs["rewards"], rl.outputs["kl_div"], strict=True)
    ):
        print(f"  rl step  {step:3d}  reward/mean {reward:.3f}  actor/kl {kl:.5f}")
    k = max(1, len(rl.outputs["rewards"]) // 4)
    first = sum(rl.outputs["rewards"][:k]) / k
    last = sum(rl.outputs["rewards"][-k:]) / k
    print(f"reward: first {k} RL step(s) {first:.3f} -> last {k} {last:.3f}")
    print(f"metrics: {sft.run_dir}/metrics.jsonl, {rl.run_dir}/metrics.jsonl")
    return {"sft_loss": [r["actor/sft_loss"] for r in sft.metrics], **rl.outputs}


if __name__ == "__main__":
    main()

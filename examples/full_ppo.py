"""Full PPO: actor, critic, reference and reward, with the issue's step logic.

    response = actor.generate(prompt)
    reward_score = reward.score(prompt, response)
    ref_logprob = ref.get_logprob(prompt, response)
    actor_logprob = actor.get_logprob(prompt, response)
    kl_div = actor_logprob - ref_logprob
    loss = ppo_loss(reward_score, kl_div, lam=0.95)
    actor.update(loss)

With a critic declared, `ppo_loss` estimates advantages with GAE on the critic's
values, the KL (k1, the difference of log-probs) becomes a penalty in the reward with
an adaptive coefficient, and the critic learns from the GAE returns: the same plan as
the bundled `ppo` preset. Placement from device mappings: actor, rollout and reference
share one process (the hybrid engine, identical mappings); the critic and the reward
function get processes of their own (CPU slots 1 and 2), so their work overlaps.

    python examples/full_ppo.py [--steps 6] [--log-dir runs/full_ppo] [--yaml FILE]

Prints the placement, per-step reward / KL / value loss; --yaml also writes the
equivalent topology file (runnable with `hybridflow run FILE`).
"""

from __future__ import annotations

import argparse

from hybridflow import DataflowBuilder

LOGIC = __doc__.split("\n\n")[1]


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--log-dir", default="runs/full_ppo")
    ap.add_argument("--yaml", default=None, help="also write the equivalent topology file")
    args = ap.parse_args(argv)

    df = DataflowBuilder("full_ppo", seed=0)
    df.add_actor(model_name="tiny", device_mapping={"actor": "cpu"}, lr=3e-3, max_new_tokens=3)
    df.add_critic(model_name="tiny", device_mapping={"critic": "cpu:1"}, lr=3e-3)
    df.add_reward_function("hybridflow.data.tasks:last_digit_reward", device_mapping="cpu:2")
    df.add_reference_model(model_name="tiny", device_mapping={"ref": "cpu"})
    df.define_training_step(inputs=["prompt"], outputs=["loss", "kl_div", "rewards"], logic=LOGIC)
    df.configure(step_batch=32, micro_batch=16)
    engine = df.build(log_level="WARNING", metrics_backend="jsonl", log_dir=args.log_dir)
    topo = df.topology(log_dir=args.log_dir)
    for name, stage in topo.stages.items():
        print(f"stage {name:8} device {stage.devices!s:5} roles {', '.join(stage.roles)}")
    if args.yaml:
        df.to_yaml(args.yaml, steps=args.steps)
        print(f"topology written to {args.yaml}")

    result = engine.train("last_digit", steps=args.steps)
    for step, row in enumerate(result.metrics):
        print(
            f"step {step:3d}  reward/mean {row['reward/mean']:.3f}  actor/kl "
            f"{row.get('actor/kl', float('nan')):+.5f}  critic/vf_loss "
            f"{row['critic/vf_loss']:.4f}  actor/pg_loss {row['actor/pg_loss']:+.4f}"
        )
    print(f"metrics: {result.run_dir}/metrics.jsonl  checkpoint: {result.checkpoint}")
    return result.outputs


if __name__ == "__main__":
    main()

"""`hybridflow bench engine-reuse --json`: what a second Engine call costs.

Builds the tiny CPU GRPO job (actor + rollout + reference in one process, a reward
function in another; the `tiny` preset model) and times, on one Engine:
  first_train_s    the first `train(steps=1)`: starts the stage processes, loads every
                   model, runs one step and its checkpoint
  second_train_s   the second `train(steps=1)`: the same processes (no startup)
  later_train_median_s  median of the second and the next calls (3; 1 with --quick)
  run_s            a `run(prompts)` after them (generate + score on the same processes)
  startup_s        first_train_s - later_train_median_s: what reusing the processes saves
and prints one JSON object (also `steps`, `step_batch`, and `same_pids`: whether the
second call ran on the processes of the first).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

from hybridflow.bench import refuse_sets
from hybridflow.pipeline.api.builder import DataflowBuilder

LOGIC = """
response = actor.generate(prompt, n=4)
reward_score = reward.score(prompt, response)
ref_logprob = ref.get_logprob(prompt, response)
actor_logprob = actor.get_logprob(prompt, response)
kl_div = kl(actor_logprob, ref_logprob, kind="k3")
loss = grpo_loss(reward_score, kl_div)
actor.update(loss)
"""


def builder(step_batch: int) -> DataflowBuilder:
    df = DataflowBuilder("engine-reuse", seed=0)
    df.add_actor("tiny", device_mapping="cpu", lr=1e-3, max_new_tokens=4)
    df.add_reference_model("tiny")
    df.add_reward_function("hybridflow.data.tasks:last_digit_reward")
    df.define_training_step(["prompt"], ["loss", "rewards"], LOGIC)
    df.configure(step_batch=step_batch, micro_batch=step_batch // 2)
    return df


def run(args: argparse.Namespace) -> dict[str, Any]:
    refuse_sets(args, "engine_reuse")
    step_batch = 8 if getattr(args, "quick", False) else 16
    repeats = 1 if getattr(args, "quick", False) else 3
    with (
        tempfile.TemporaryDirectory(prefix="hf-bench-reuse-") as log_dir,
        builder(step_batch).build(metrics_backend="null", log_dir=log_dir) as engine,
    ):
        t0 = time.perf_counter()
        engine.train("last_digit", steps=1)
        first = time.perf_counter() - t0
        pids = engine.pids()
        later = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.train("last_digit", steps=1)
            later.append(time.perf_counter() - t0)
        same = engine.pids() == pids
        t0 = time.perf_counter()
        engine.run(["last:123=", "last:4567="])
        run_s = time.perf_counter() - t0
    return {
        "first_train_s": round(first, 3),
        "second_train_s": round(later[0], 3),
        "later_train_median_s": round(statistics.median(later), 3),
        "run_s": round(run_s, 3),
        "startup_s": round(first - statistics.median(later), 3),
        "same_pids": same,
        "steps": 1,
        "step_batch": step_batch,
    }

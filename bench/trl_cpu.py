"""The TRL side of the CPU GRPO comparison (issue 25): TRL's `GRPOTrainer` on the work of
`hybridflow bench step --config grpo` with the `small` model, 64 samples, 32 new tokens.

Runs in its own venv (TRL is not a hybridflow dependency), with the repository on the
path for the model shape, the tokenizer and the task (so both sides build the same
model from the same config and seed, and sample prompts from the same task):

    python3 -m venv /tmp/trlvenv
    /tmp/trlvenv/bin/pip install torch==2.13.0 transformers==5.24.0 accelerate==1.16.0 \\
        datasets==5.2.0 trl==1.16.0 pyzmq==27.3.0 msgspec==0.23.0  # the last two: hybridflow imports
    PYTHONPATH=. /tmp/trlvenv/bin/python bench/trl_cpu.py --steps 6 | tail -1  # TRL logs to stdout

The same work per step as the hybridflow run (`bench/RESULTS.md`, "CPU GRPO against
TRL"): 8 prompts x 8 samples of the built-in `last_digit` task, at most 32 new tokens,
temperature 1, no top-k/top-p; the `small` preset (Qwen2 shape, ~3M parameters, random
init, seed 0) in float32 as policy and reference; reward = the task's rule; GRPO
advantages normalised by the group std; token-mean loss ("dapo": over the step's
tokens), clip 0.2 / 0.28, KL to the reference as a loss term (beta 0.01, k3), lr 3e-3,
grad clip 1; one optimizer step per 64 samples, in 2 micro-batches of 32; the
old log-probs are the current ones (one update per rollout), so no extra forward.

Printed (JSON): samples_per_s = 64 / the median period between two optimizer-step ends
over the steps after the first (a warm-up, reported apart), as `bench step` reports
hybridflow's; step_s per timed step; torch's thread counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import torch

SAMPLES = 8  # per prompt (the group)
STEP_BATCH = 64  # samples per optimizer step
MICRO_BATCH = 32


def build_model_dir(directory: str, model: str, seed: int) -> Any:
    """Save the preset model (random init, `seed`) and the built-in tokenizer to
    `directory`: TRL builds its reference from the policy's path."""
    from hybridflow.models import ModelOptions, builtin_tokenizer, load_model, save_pretrained

    tok = builtin_tokenizer()
    save_pretrained(load_model(ModelOptions(model=model), tok, seed=seed), tok, directory)
    return tok


def dataset(n: int, seed: int) -> Any:
    from datasets import Dataset

    from hybridflow.data.tasks import get_task

    rows = get_task("last_digit").prompts(n, seed)
    return Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])


def reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
    from hybridflow.data.tasks import TASKS

    score = TASKS["last_digit"].score
    return [score(c, a) for c, a in zip(completions, answer, strict=True)]


class StepClock:
    """Wall time at each optimizer step's end (a transformers TrainerCallback)."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def hook(self) -> Any:
        from transformers import TrainerCallback

        clock = self

        class _Cb(TrainerCallback):
            def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                clock.marks.append(time.perf_counter())

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                clock.marks.append(time.perf_counter())

        return _Cb()


def time_phases(trainer: Any) -> dict[str, list[float]]:
    """Wrap the trainer's generation (`model.generate`), its whole rollout
    (`_generate_and_score_completions`: generation, rewards, reference and old log-probs)
    and its `training_step` (forward + loss + backward of one micro-batch) with wall
    clocks -> name: seconds per optimizer step (appended once per step)."""
    out: dict[str, list[float]] = {"generate": [], "rollout": [], "train": []}
    acc = {k: 0.0 for k in out}

    def wrap(obj: Any, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[key] += time.perf_counter() - t0

        setattr(obj, name, timed)

    wrap(trainer.model, "generate", "generate")
    wrap(trainer, "_generate_and_score_completions", "rollout")
    wrap(trainer, "training_step", "train")
    from transformers import TrainerCallback

    class _Flush(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            for k in out:
                out[k].append(acc[k])
                acc[k] = 0.0

    trainer.add_callback(_Flush())
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from trl import GRPOConfig, GRPOTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_model_dir(f"{tmp}/model", args.model, args.seed)
        cfg = GRPOConfig(
            output_dir=f"{tmp}/out",
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            max_steps=args.steps,
            seed=args.seed,
            learning_rate=3e-3,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            per_device_train_batch_size=MICRO_BATCH,
            gradient_accumulation_steps=STEP_BATCH // MICRO_BATCH,
            num_generations=SAMPLES,
            max_completion_length=args.max_new_tokens,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            beta=0.01,
            epsilon=0.2,
            epsilon_high=0.28,
            loss_type="dapo",
            scale_rewards="group",
            dataloader_num_workers=0,
        )
        clock = StepClock()
        trainer = GRPOTrainer(
            model=f"{tmp}/model",
            reward_funcs=reward,
            args=cfg,
            train_dataset=dataset(4096, args.seed),
            processing_class=tok,
            callbacks=[clock.hook()],
        )
        phases = time_phases(trainer)
        trainer.train()
    periods = [b - a for a, b in zip(clock.marks, clock.marks[1:], strict=False)]
    timed = periods[1:] or periods
    period = statistics.median(timed)
    return {
        "bench": "trl_cpu",
        "trl_steps": len(periods),
        "samples_per_s": round(STEP_BATCH / period, 3),
        "period_s": round(period, 4),
        "warmup_step_s": round(periods[0], 4),
        "step_s": [round(p, 4) for p in timed],
        # seconds per step (median over the timed steps) inside TRL's own methods
        "phases": {k: round(statistics.median(v[1:] or v), 4) for k, v in phases.items()},
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--model", default="small")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    print(json.dumps(run(p.parse_args())))


if __name__ == "__main__":
    main()

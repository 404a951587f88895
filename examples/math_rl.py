"""Math RL from scratch: GSM8K-style word problems -> SFT -> GRPO with a verifier, validated
on a held-out split.

The whole path a user takes on GSM8K, with a model of its own (no weights can be
downloaded here):

  1. data       synthetic GSM8K-style problems (hybridflow.data.word_problems) written
                as train.parquet / test.parquet in verl's RL data format (`prompt` chat
                messages, `reward_model.ground_truth`, the worked solution in
                `extra_info.answer`); train and test share no question
  2. tokenizer  a BPE tokenizer trained on the train split with a chat template
                (models/tokenizer.py `train_tokenizer`), saved with save_pretrained
  3. SFT        `engine.sft` on the worked solutions: the prompts go through the same
                chat template as RL's, so SFT trains on exactly the RL prompt tokens
  4. GRPO       `engine.train` with the gsm8k verifier as the reward (verl's
                `compute_score` signature, exact match of the last `#### N`), no KL
                term, validated greedily on the held-out split before RL, every
                `--val-interval` steps and at the end

It prints the validation accuracy per validation step, before (the SFT model) and after
RL, writes <out>/plot.png (validation accuracy and training reward per step) and
<out>/summary.json, and exits 1 when RL raised held-out accuracy by less than
`--goal-points` (10) points over the SFT model.

    python examples/math_rl.py --quick          # CPU, 2 cores (see the timings below)
    python examples/math_rl.py --device cuda:0  # one GPU: the Qwen2-0.5B shape, 512 tokens
    python examples/math_rl.py --device cuda:0 --lora-rank 64 --rl-lr 1e-4  # GRPO on LoRA

`--quick` is sized so that a 1.4M-parameter model (`small` narrowed to hidden 192, 3
layers) learns the easy problems (2 steps, numbers up to 9, results up to 20) by SFT to
a held-out accuracy well short of 100%, leaving GRPO room (16 prompts x 8 samples per
step, lr 1e-4, 80 steps). Without `--quick` the problems are harder (2-3 steps, numbers
up to 20, results up to 60) and the model is the Qwen2-0.5B shape with responses up to 512
tokens, sampled by the native engine: a setting for one GPU (FULL below).

Measured on one H200 (the default setting, seed 0; bench/RESULTS.md): SFT 48.2% -> 70.2%
after 80 GRPO steps (+22.0 points), 172 samples/s in RL, 6 minutes in all.

Measured with --quick (256 held-out problems, greedy):
  - seed 0 on the 2-core CPU machine, shared with other jobs: SFT 48.8% ->
    67.2% after 80 steps (+18.4 points; 57.8% at step 10, 64.1% at 30, 69.1% at 50);
    8.4 min wall (506 s: data 4, sft 137, rl with validation 357) at load 1.5-3, and
    23.4 min at load 6-11; the same numbers both times (seeded, one thread per process).
  - one core per run on a 16-core host (other library versions, so other initial
    weights): sft 86 s, 60 RL steps with validation 160 s; the rise by step 50-60 over
    seeds 0-6: +13.3, +11.7, +12.5, +7.8, +17.6, +8.2 (at step 40), +12.9 points. The
    seeds that rose least started lowest (SFT 33% and 16%) and were still rising.
  - what did not work: fewer SFT steps (150: a weaker start that GRPO hardly moved),
    RL lr >= 2e-4 (accuracy fell, or rose less), 4 samples per prompt (a smaller rise),
    harder problems (SFT 5-11%, +2-3 points in 40 steps).
"""

from __future__ import annotations

import os

# One intra-op thread per process, as `hybridflow demo` sets (hybridflow/demo.py says why:
# busy processes with OpenMP pools each spin against one another on 2 cores). Set before
# torch is imported by anything.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from hybridflow import DataflowBuilder
from hybridflow.data import word_problems as wp

VERIFIER = "hybridflow.reward.scorers.gsm8k:compute_score"
ACC_KEY = f"val/{wp.DATA_SOURCE}/acc/mean"


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every size of one run; `--quick` and the default are two of these."""

    difficulty: wp.Difficulty
    n_train: int
    n_test: int
    vocab_size: int
    model: str
    model_overrides: dict[str, int]  # the preset's shape changes (dropped by --model)
    sft_steps: int
    sft_batch: int
    sft_lr: float
    rl_steps: int
    prompts_per_step: int
    samples_per_prompt: int
    rl_lr: float
    max_new_tokens: int
    val_interval: int
    sft_warmup_steps: int  # linear lr warm-up of SFT (optimizer steps); RL has none
    rollout: str  # the sampler's engine: auto (native on a GPU, else hf), hf, native
    # > 0: GRPO trains rank-r LoRA adapters (all-linear, alpha 2r) on the SFT model, which
    # SFT trains in full first (LoRA on a model trained from scratch would learn nothing)
    lora_rank: int = 0


# `small` narrowed to hidden 192 and 3 layers (~1.5M parameters): on the quick problems
# it learned as much by SFT as `small` in ~60% of the time, and GRPO raised it more
# (measured: the module docstring).
_QUICK_SHAPE = {
    "hidden_size": 192,
    "intermediate_size": 576,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
QUICK = Settings(
    difficulty=wp.Difficulty(min_steps=2, max_steps=2, max_number=9, max_result=20),
    n_train=4000,
    n_test=256,
    vocab_size=384,
    model="small",
    model_overrides=_QUICK_SHAPE,
    sft_steps=200,
    sft_batch=32,
    sft_lr=1.5e-3,
    rl_steps=80,
    prompts_per_step=16,
    samples_per_prompt=8,
    rl_lr=1e-4,
    max_new_tokens=40,
    val_interval=10,
    sft_warmup_steps=0,
    rollout="auto",
)
# The GPU setting (one H200): the Qwen2-0.5B shape (24 layers, hidden 896) trained from
# scratch, harder problems, responses up to 512 tokens, the native rollout engine; about
# 6 minutes there (bench/RESULTS.md). A 0.5B model from scratch wants a lower lr and a
# warm-up than the small one, RL a lower lr again. 250 SFT steps leave GRPO room: 600
# reached 90.4% held-out by SFT alone (98.2% after 60 GRPO steps), 150 only 14.4%.
FULL = Settings(
    difficulty=wp.Difficulty(min_steps=2, max_steps=3, max_number=20, max_result=60),
    n_train=20000,
    n_test=500,
    vocab_size=512,
    model="qwen2-0.5b",
    model_overrides={},
    sft_steps=250,
    sft_batch=64,
    sft_lr=3e-4,
    rl_steps=80,
    prompts_per_step=32,
    samples_per_prompt=8,
    rl_lr=1e-5,
    max_new_tokens=512,
    val_interval=10,
    sft_warmup_steps=30,
    rollout="auto",
)

_NOT_FLAGS = ("difficulty", "model_overrides")

LOGIC = """
response = actor.generate(prompt, n={n})
reward_score = reward.score(prompt, response)
loss = grpo_loss(reward_score)
actor.update(loss)
"""


def parser(base: Settings, out: str, description: str) -> argparse.ArgumentParser:
    """The command line of an example whose sizes are `base`'s fields (every field but
    _NOT_FLAGS is a flag: --rl-steps 80, --model qwen2-0.5b, ...)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="the CPU setting (under 10 minutes)")
    ap.add_argument("--out", default=out)
    ap.add_argument("--device", default="cpu", help="cpu, cuda:0, ...")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--goal-points", type=float, default=10.0)
    for name in _sizes(base):
        ap.add_argument("--" + name.replace("_", "-"), type=type(getattr(base, name)))
    return ap


def settings(args: argparse.Namespace, quick: Settings, full: Settings) -> Settings:
    """The chosen setting (`--quick` or the default) with the flags given replacing sizes."""
    base = quick if args.quick else full
    given = {n: getattr(args, n) for n in _sizes(base) if getattr(args, n) is not None}
    if "model" in given and given["model"] != base.model:
        given["model_overrides"] = {}  # another preset: its own shape
    return dataclasses.replace(base, **given)


def _sizes(base: Settings) -> list[str]:
    return [f.name for f in dataclasses.fields(base) if f.name not in _NOT_FLAGS]


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Settings]:
    args = parser(QUICK, "runs/math_rl", __doc__.split("\n")[0]).parse_args(argv)
    return args, settings(args, QUICK, FULL)


def make_tokenizer(
    train_path: Path,
    s: Settings,
    directory: Path,
    *,
    chat_template: str | None = None,
    extra: Iterable[str] = (),
) -> Path:
    """A BPE tokenizer with a chat template (CHAT_TEMPLATE by default), trained on the
    train split's text and the `extra` lines."""
    from hybridflow.data.sources import load_records
    from hybridflow.models.tokenizer import CHAT_TEMPLATE, train_tokenizer

    def corpus():
        for rec in load_records(str(train_path)):
            yield rec["prompt"][0]["content"]
            yield rec["extra_info"]["answer"]
        yield from extra

    template = chat_template or CHAT_TEMPLATE
    tok = train_tokenizer(corpus(), s.vocab_size, chat_template=template)
    tok.save_pretrained(str(directory))
    return directory


def build(
    args: argparse.Namespace,
    s: Settings,
    tokenizer: Path,
    out: Path,
    *,
    name: str = "math_rl",
    environment: dict[str, Any] | None = None,
    lora: bool = False,
) -> Any:
    """The GRPO job; `environment`: add_environment's arguments (multi-turn rollouts
    whose environment gives the reward), else the verifier scores single responses.
    `lora`: the actor trains `s.lora_rank` adapters on `s.model` (the SFT model's
    directory), logging to <out>/run_lora."""
    df = DataflowBuilder(name, seed=args.seed)
    gpu = args.device.startswith("cuda")
    engine = s.rollout if s.rollout != "auto" else ("native" if gpu else "hf")
    # On a GPU: fp32 master weights with bf16 autocast for training, a bf16 sampler
    # (grpo-gpu's choice); on the CPU everything stays fp32.
    precision: dict[str, Any] = {"dtype": "float32", "autocast_bf16": True} if gpu else {}
    if gpu:  # backward over 64 rows at a time: 256 rows x 560 tokens x 24 layers is ~120 GB
        precision["forward_batch_size"] = 64
    if lora:
        r = s.lora_rank
        precision.update(lora_rank=r, lora_alpha=2 * r, lora_target_modules="all-linear")
    df.add_actor(
        model_name=s.model,
        device_mapping=args.device,
        tokenizer=str(tokenizer),
        model_overrides=dict(s.model_overrides),
        lr=s.rl_lr,
        max_new_tokens=s.max_new_tokens,
        temperature=1.0,
        # The sampler's log-probs are the PPO ratio's "old" policy (same weights: exact).
        old_logprob_key="rollout_logprobs",
        rollout_backend=engine,
        rollout={"dtype": "bfloat16"} if gpu else None,
        **precision,
    )
    if environment is None:
        df.add_reward_function(VERIFIER, device_mapping="cpu")
    else:
        df.add_environment(**environment)
    df.define_training_step(
        inputs=["prompt"],
        outputs=["loss", "rewards"],
        logic=LOGIC.format(n=s.samples_per_prompt),
    )
    batch = s.prompts_per_step * s.samples_per_prompt
    df.configure(step_batch=batch, micro_batch=batch)
    run_dir = out / ("run_lora" if lora else "run")
    return df.build(log_level="WARNING", metrics_backend="jsonl", log_dir=str(run_dir))


def accuracy(row: dict[str, float], key: str = ACC_KEY) -> float:
    if key not in row:
        raise KeyError(f"validation row has no {key!r}: {sorted(row)}")
    return row[key]


def plot(
    val: list[dict[str, float]],
    train: list[dict[str, float]],
    path: Path,
    series: dict[str, str] | None = None,
) -> None:
    """Left: the validation `series` (label -> key of a 0..1 metric; held-out accuracy
    by default) per RL step; right: the training reward."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = series or {"held-out accuracy": ACC_KEY}
    fig = Figure(figsize=(10, 3.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax_v, ax_r = fig.subplots(1, 2)
    for label, key in series.items():
        ax_v.plot(
            [r["step"] for r in val], [100 * accuracy(r, key) for r in val], "o-", label=label
        )
    first = next(iter(series.values()))
    ax_v.set(title="validation (greedy)", xlabel="RL step", ylabel="%")
    ax_v.set_ylim(0, 100)
    ax_v.axhline(100 * accuracy(val[0], first), color="grey", ls=":", label="SFT model")
    ax_v.legend(loc="lower right")
    steps = [r["step"] for r in train if "reward/mean" in r]
    ax_r.plot(steps, [r["reward/mean"] for r in train if "reward/mean" in r])
    ax_r.set(title="training reward (sampled, T=1)", xlabel="RL step", ylabel="reward/mean")
    fig.savefig(str(path))


def validation_options(test_path: Path, s: Settings) -> dict[str, Any]:
    """Greedy on the held-out split before RL, every val_interval steps and at the end."""
    return {
        "source": str(test_path),
        "interval": s.val_interval,
        "before_train": True,
        "after_train": True,
        "temperature": 0.0,
        "n": 1,
        "max_new_tokens": s.max_new_tokens,
        "generations": 4,
    }


def sft_then_rl(
    engine: Any,
    s: Settings,
    pairs: list[dict[str, Any]],
    train_path: Path,
    test_path: Path,
    rebuild: Callable[[Path], Any] | None = None,
) -> tuple[list[float], Any, dict[str, float]]:
    """SFT on `pairs`, then GRPO with validation; closes the engine(s). With `rebuild`,
    GRPO runs on `rebuild(the SFT policy's directory)`, another job.
    -> (SFT losses, the RL TrainResult, seconds per phase)."""
    times: dict[str, float] = {}
    try:
        t = time.perf_counter()
        sft = engine.sft(
            pairs,
            steps=s.sft_steps,
            batch_size=s.sft_batch,
            lr=s.sft_lr,
            warmup_steps=s.sft_warmup_steps or None,
        )
        times["sft_s"] = time.perf_counter() - t
        losses = [r["actor/sft_loss"] for r in sft.metrics]
        print(f"SFT: {s.sft_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        if rebuild is not None:  # the SFT checkpoint's policy is a save_pretrained directory
            engine.close()
            engine = rebuild(Path(sft.checkpoint) / "policy")
        t = time.perf_counter()
        rl = engine.train(
            str(train_path), steps=s.rl_steps, validation=validation_options(test_path, s)
        )
        times["rl_s"] = time.perf_counter() - t
    finally:
        engine.close()
    return losses, rl, times


def table(val: list[dict[str, float]], columns: dict[str, str]) -> None:
    """One line per validation step: `columns` (header -> key of a 0..1 metric) in %."""
    print("\n  step" + "".join(f"  {h:>14}" for h in columns))
    for r in val:
        cells = "".join(f"  {100 * accuracy(r, k):13.1f}%" for k in columns.values())
        print(f"  {int(r['step']):4d}{cells}")


def save(
    out: Path,
    args: argparse.Namespace,
    s: Settings,
    rl: Any,
    losses: list[float],
    times: dict[str, float],
    summary: dict[str, Any],
) -> dict[str, Any]:
    """<out>/summary.json: `summary` plus what every run records (training reward, SFT
    losses, wall times, settings, run directory); -> the whole summary."""
    summary = {
        **summary,
        "train_reward": [r.get("reward/mean") for r in rl.metrics],
        "sft_loss": losses,
        "wall": {k: round(v, 1) for k, v in times.items()},
        "settings": {**dataclasses.asdict(s), "device": args.device, "seed": args.seed},
        "run_dir": rl.run_dir,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"plot: {out / 'plot.png'}  summary: {out / 'summary.json'}")
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    args, s = parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    train_path, test_path = wp.write_dataset(
        out / "data", s.n_train, s.n_test, seed=args.seed, difficulty=s.difficulty
    )
    tokenizer = make_tokenizer(train_path, s, out / "tokenizer")
    times = {"data_s": time.perf_counter() - t0}
    print(f"data: {train_path} ({s.n_train}), {test_path} ({s.n_test}); tokenizer: {tokenizer}")

    # Engine.sft takes {prompt, response} records: the chat prompt as is (templated
    # like RL's) and the worked solution as the response.
    from hybridflow.data.sources import load_records

    pairs = [
        {"prompt": r["prompt"], "response": r["extra_info"]["answer"]}
        for r in load_records(str(train_path))
    ]

    def lora_job(policy: Path) -> Any:
        on_sft = dataclasses.replace(s, model=str(policy), model_overrides={})
        return build(args, on_sft, tokenizer, out, lora=True)

    losses, rl, phase_times = sft_then_rl(
        build(args, s, tokenizer, out),
        s,
        pairs,
        train_path,
        test_path,
        rebuild=lora_job if s.lora_rank else None,
    )
    times.update(phase_times, total_s=time.perf_counter() - t0)

    val = sorted(rl.validation, key=lambda r: r["step"])
    before, after = accuracy(val[0]), accuracy(val[-1])
    rise = 100 * (after - before)
    ok = math.isfinite(rise) and rise >= args.goal_points
    table(val, {"held-out acc": ACC_KEY, "val reward": "val/reward/mean"})
    print(
        f"held-out accuracy: SFT {100 * before:.1f}% -> after {s.rl_steps} GRPO steps "
        f"{100 * after:.1f}% ({rise:+.1f} points; goal >= +{args.goal_points:g}): "
        f"{'OK' if ok else 'NOT MET'}"
    )
    print("wall: " + ", ".join(f"{k.removesuffix('_s')} {v:.0f}s" for k, v in times.items()))
    plot(val, rl.metrics, out / "plot.png")
    return save(
        out,
        args,
        s,
        rl,
        losses,
        times,
        {
            "sft_acc": before,
            "rl_acc": after,
            "rise_points": rise,
            "goal_points": args.goal_points,
            "ok": ok,
            "validation": [{"step": int(r["step"]), "acc": accuracy(r)} for r in val],
        },
    )


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)

"""Tool-using math RL from scratch: the model may call a calculator between its turns.

examples/math_rl.py's pipeline (synthetic GSM8K-style problems -> a BPE tokenizer with a
chat template -> SFT from scratch -> GRPO with greedy validation on a held-out split),
with the rollouts multi-turn: each prompt is played in the `calculator` environment
(hybridflow.stages.env.builtin.calculator), where a turn that writes a hermes call

    <tool_call>{"name":"calc","arguments":{"expression":"17*4"}}</tool_call>

gets the result back as a tool message and the model continues; the first turn without a
call ends the trajectory and is scored by the gsm8k verifier (strict `#### N`), which is
the run's reward (the `env` reward backend). The differences from math_rl, phase by phase:

  1. data        larger numbers than math_rl's quick problems (one step of +, - or *,
                 numbers up to 50, results up to 200), where a 1.5M-parameter model's
                 own arithmetic is weak but copying numbers into a call is easy
  2. tokenizer   TOOL_CHAT_TEMPLATE (CHAT_TEMPLATE plus a `<|tool|>` role), trained on
                 the problems and the demonstrations' tool calls
  3. SFT         demonstrations rendered exactly as the rollout lays out a trajectory: the
                 worked solution where each step, with probability `tool_share`, is a
                 `calc` call ending the turn ("She sells 7: <tool_call>...</tool_call>"),
                 the real CalculatorEnv's observation of it (encoded by the loop's own
                 ObservationEncoder: "\\n<|tool|>\\n38\\n<|assistant|>\\n"), and the
                 next turn, ..., ending with `#### N`; the loss is on the model's
                 tokens only (response_mask 0 on the observations, as in RL)
  4. GRPO        `add_environment("calculator")`; validation runs the same multi-turn
                 rollout greedily and reports the tool-use rate
                 (val/<source>/multi_turn/mean: trajectories that called the tool)

SFT shows the tool on only part of the steps (tool_share 0.2), so greedy decoding after
SFT mostly computes in its head; RL finds that the trajectories that call the tool are
right more often, and raises the tool-use rate and the accuracy with it.

`--no-tool` is the comparison: math_rl's pipeline (single-turn, the verifier as the
reward, plain worked solutions) with every size the same, on the same problems.

It prints a table per validation step (accuracy, tool-use rate), writes
<out>/plot.png and <out>/summary.json, and exits 1 unless RL raised held-out accuracy
by --goal-points (10) points and the tool-use rate by --goal-tool-points (20) points
(with --no-tool: accuracy only).

    python examples/agent_math.py --quick            # CPU, 2 cores: under 10 minutes
    python examples/agent_math.py --quick --no-tool  # the same budget without the tool

Without --quick: math_rl's GPU setting (the Qwen2-0.5B shape, native rollout) on 2-3 step
problems with numbers to 50 and results to 500; not run yet.

Measured with --quick (256 held-out problems, greedy; bench/RESULTS.md), on the 2-core
CPU machine shared with another engineer's jobs, one run at a time:
  - seed 0, with the tool: held-out accuracy 4.3% after SFT (greedy decoding computes in
    its head: 0.8% of trajectories call the tool) -> 62.9% at RL step 10 -> 73.4% after
    30 GRPO steps (+69.1 points); tool use 0.8% -> 100% from step 10 on; sampled tool
    calls per training trajectory 0.23 -> 1.0. 7.8 min (`time`: 7m50s; data 25 s, SFT
    112 s, RL with 4 validations 324 s) at load 2.2-4.1.
  - seed 0, without the tool (--no-tool, the same sizes and problems): 2.7% after SFT
    -> 2.0% after 30 GRPO steps (4.3% at step 20); 3.9 min. 200 SFT steps do not teach
    a 1.5M model two-digit arithmetic ("37+17=44"), and GRPO finds almost no correct
    sample to learn from; with the tool it only copies two numbers and an operator.
  - seed 1 (40 RL steps): 3.9% -> 82.8% at step 30 (83.6% at 40), tool use 0% -> 100%;
    9.7 min for 40 steps at load 3-4.5.
  - what did not work: tool_share 1/3 (seed 0: 3.5% -> 88.7% in 40 steps, but seed 1's
    greedy SFT model already called the tool on every problem: no rise to show); two-step
    problems with results to 99 (SFT 6.2%, ~16 s per RL step: far over 10 minutes).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per process: math_rl.py says why

import asyncio
import dataclasses
import json
import math
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import math_rl

from hybridflow.data import word_problems as wp

ENV = "calculator"
ACC_KEY = f"val/{wp.DATA_SOURCE}/reward/mean"  # the env's reward: the verifier's 1 or 0
TOOL_KEY = f"val/{wp.DATA_SOURCE}/multi_turn/mean"  # past turn 1: a tool was called
TURNS_KEY = f"val/{wp.DATA_SOURCE}/turns/mean"
# One step of a worked solution: "17*4=68" (word_problems writes exactly this shape).
_STEP = re.compile(r"(\d+)([+\-*])(\d+)=(\d+)")


@dataclasses.dataclass(frozen=True)
class Settings(math_rl.Settings):
    tool_share: float = 0.2  # each demonstrated step is a calc call with this probability
    max_turns: int = 4  # model turns per trajectory (a call per step, then the answer)


def _agent(base: math_rl.Settings, **changes: Any) -> Settings:
    """math_rl's setting `base` as this example's, with `changes`."""
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(math_rl.Settings)}
    return Settings(**{**fields, **changes})


QUICK = _agent(
    math_rl.QUICK,
    difficulty=wp.Difficulty(
        min_steps=1,
        max_steps=1,
        max_number=50,
        max_result=200,
        ops=("add", "sub", "mul"),
        max_factor=4,
    ),
    max_new_tokens=32,
    rl_steps=30,
)
FULL = _agent(
    math_rl.FULL,
    difficulty=wp.Difficulty(
        min_steps=2,
        max_steps=3,
        max_number=50,
        max_result=500,
        ops=("add", "sub", "mul"),
        max_factor=9,
    ),
)


def tool_call(expression: str) -> str:
    """A hermes call of `calc`, compact (every character is a token to generate)."""
    body = {"name": "calc", "arguments": {"expression": expression}}
    return "<tool_call>" + json.dumps(body, separators=(",", ":")) + "</tool_call>"


def tool_turns(solution: str, use_tool: list[bool]) -> list[str]:
    """A worked solution ("Ann has 7+5=12 apples.\\nShe sells 3: 12-3=9.\\n#### 9") as
    model turns: a step with use_tool[k] ends its turn with the calc call in place of its
    arithmetic ("She sells 3: <tool_call>...</tool_call>"); the last turn holds "#### N"."""
    *steps, answer = solution.split("\n")
    if len(use_tool) != len(steps):
        raise ValueError(f"{len(steps)} steps but {len(use_tool)} choices")
    turns, lines = [], []
    for line, tool in zip(steps, use_tool, strict=True):
        m = _STEP.search(line)
        if m is None:
            raise ValueError(f"no arithmetic step in {line!r}")
        if tool:
            turns.append("\n".join([*lines, line[: m.start()] + tool_call(m[1] + m[2] + m[3])]))
            lines = []
        else:
            lines.append(line)
    turns.append("\n".join([*lines, answer]))
    return turns


async def _demonstration(
    record: dict[str, Any], turns: list[str], tokenizer: Any, encoder: Any, max_turns: int
) -> tuple[list[int], list[int]]:
    """`turns` played through the real environment -> (response ids, response mask): each
    turn's tokens and its stop token (mask 1), then the observation the rollout would
    append (mask 0); the verifier must accept the result."""
    from hybridflow.stages.env.builtin.calculator import CalculatorEnv
    from hybridflow.stages.env.protocol import Action

    env = CalculatorEnv(max_turns=max_turns)
    env.reset(record)
    ids: list[int] = []
    mask: list[int] = []
    for k, text in enumerate(turns):
        turn = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        res = await env.step(Action(text, tuple(turn)))
        ids += turn
        mask += [1] * len(turn)
        if res.done:
            if k != len(turns) - 1 or res.reward != 1.0:
                raise AssertionError(f"demonstration of {record['extra_info']} is wrong: {turns}")
            return ids, mask
        obs = encoder.encode(res.observation, closed=True)
        ids += obs
        mask += [0] * len(obs)
    raise AssertionError(f"the environment did not end after {turns}")


def sft_pairs(
    records: list[dict[str, Any]], tokenizer_dir: Path, s: Settings, seed: int
) -> list[dict[str, Any]]:
    """The SFT demonstrations (module docstring, phase 3) as token-id responses."""
    from hybridflow.models.loader import load_tokenizer
    from hybridflow.stages.env.builtin.calculator import CalculatorEnv
    from hybridflow.stages.env.observations import ObservationEncoder

    tok = load_tokenizer(str(tokenizer_dir))
    encoder = ObservationEncoder(tok, tools=CalculatorEnv().tools_schema())
    choices = _tool_choices(records, s.tool_share, seed)

    async def render() -> list[tuple[list[int], list[int]]]:
        return [
            await _demonstration(
                r, tool_turns(r["extra_info"]["answer"], c), tok, encoder, s.max_turns
            )
            for r, c in zip(records, choices, strict=True)
        ]

    return [
        {"prompt": r["prompt"], "response": ids, "response_mask": mask}
        for r, (ids, mask) in zip(records, asyncio.run(render()), strict=True)
    ]


def _tool_choices(records: list[dict[str, Any]], share: float, seed: int) -> list[list[bool]]:
    rng = random.Random(f"agent_math/{seed}")
    steps = [r["extra_info"]["answer"].count("\n") for r in records]
    return [[rng.random() < share for _ in range(n)] for n in steps]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    ap = math_rl.parser(QUICK, "runs/agent_math", __doc__.split("\n")[0])
    ap.add_argument("--no-tool", action="store_true", help="math_rl's pipeline: no calculator")
    ap.add_argument("--goal-tool-points", type=float, default=20.0)
    args = ap.parse_args(argv)
    s = math_rl.settings(args, QUICK, FULL)
    assert isinstance(s, Settings)
    tool = not args.no_tool
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from hybridflow.data.sources import load_records
    from hybridflow.models.tokenizer import TOOL_CHAT_TEMPLATE

    train_path, test_path = wp.write_dataset(
        out / "data", s.n_train, s.n_test, seed=args.seed, difficulty=s.difficulty
    )
    records = load_records(str(train_path))
    choices = _tool_choices(records, s.tool_share if tool else 0.0, args.seed)
    tokenizer = math_rl.make_tokenizer(
        train_path,
        s,
        out / "tokenizer",
        chat_template=TOOL_CHAT_TEMPLATE if tool else None,
        extra=(
            t
            for r, c in zip(records, choices, strict=True)
            if any(c)
            for t in tool_turns(r["extra_info"]["answer"], c)
        ),
    )
    if tool:
        pairs = sft_pairs(records, tokenizer, s, args.seed)
        share = sum(map(any, choices)) / len(choices)
        print(f"SFT demonstrations: {100 * share:.0f}% call the tool ({s.tool_share:.2f} a step)")
    else:
        pairs = [{"prompt": r["prompt"], "response": r["extra_info"]["answer"]} for r in records]
    times = {"data_s": time.perf_counter() - t0}
    print(f"data: {train_path} ({s.n_train}), {test_path} ({s.n_test}); tokenizer: {tokenizer}")

    # the loop's bound on turns and the environment's own (its last turn is the answer)
    env = {"env": ENV, "env_options": {"max_turns": s.max_turns}, "max_turns": s.max_turns}
    engine = math_rl.build(
        args, s, tokenizer, out, name="agent_math", environment=env if tool else None
    )
    losses, rl, phase_times = math_rl.sft_then_rl(engine, s, pairs, train_path, test_path)
    times.update(phase_times, total_s=time.perf_counter() - t0)

    val = sorted(rl.validation, key=lambda r: r["step"])
    acc_key = ACC_KEY if tool else math_rl.ACC_KEY
    columns = {"held-out acc": acc_key, **({"tool use": TOOL_KEY} if tool else {})}
    math_rl.table(val, columns)
    before, after, rise = _rise(val, acc_key)
    print(
        f"held-out accuracy{'' if tool else ' (no tool)'}: SFT {before:.1%} -> after "
        f"{s.rl_steps} GRPO steps {after:.1%} ({rise:+.1f} points)"
    )
    ok = math.isfinite(rise) and rise >= args.goal_points
    goal = f"accuracy >= +{args.goal_points:g} points"
    tool_before = tool_after = tool_rise = 0.0
    if tool:
        tool_before, tool_after, tool_rise = _rise(val, TOOL_KEY)
        print(f"tool use: SFT {tool_before:.1%} -> {tool_after:.1%} ({tool_rise:+.1f} points)")
        ok = ok and tool_rise >= args.goal_tool_points
        goal += f", tool use >= +{args.goal_tool_points:g} points"
    print(f"goal: {goal}: {'OK' if ok else 'NOT MET'}")
    print("wall: " + ", ".join(f"{k.removesuffix('_s')} {v:.0f}s" for k, v in times.items()))
    math_rl.plot(val, rl.metrics, out / "plot.png", columns)
    keys = {"acc": acc_key, "tool_use": TOOL_KEY, "turns": TURNS_KEY}
    per_step = [
        {"step": int(r["step"]), **{k: r[v] for k, v in keys.items() if v in r}} for r in val
    ]
    return math_rl.save(
        out,
        args,
        s,
        rl,
        losses,
        times,
        {
            "tool": tool,
            "sft_acc": before,
            "rl_acc": after,
            "rise_points": rise,
            "sft_tool_use": tool_before,
            "rl_tool_use": tool_after,
            "tool_rise_points": tool_rise,
            "goal_points": args.goal_points,
            "goal_tool_points": args.goal_tool_points if tool else None,
            "ok": ok,
            "validation": per_step,
            "train_tool_calls": [r.get("rollout/tool_calls") for r in rl.metrics],
        },
    )


def _rise(val: list[dict[str, float]], key: str) -> tuple[float, float, float]:
    """-> (first, last, last - first in points) of a 0..1 validation metric."""
    first, last = math_rl.accuracy(val[0], key), math_rl.accuracy(val[-1], key)
    return first, last, 100 * (last - first)


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)

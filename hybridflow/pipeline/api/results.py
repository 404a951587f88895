"""What the Engine's calls return: `TrainResult` (train, sft) and the declared outputs of
a `run` step, read where `CompiledStep.outputs` says each one is.

`run`'s result, for P prompts and n = samples per prompt (`actor.generate(..., n=)`):
text (`response`) is a list of P str, or of P lists of n str when n > 1; a per-sample
number (`reward_score`, `rewards`) is a tensor [P] (n = 1) or [P, n]; a per-token one
(log-probs, advantages) [P, R] or [P, n, R], right-padded with 0; the prompts are the
list given; a step-level value (`loss`, `kl_div`) is a 0-d tensor (NaN when the step
reported none, e.g. every row dropped by dynamic sampling). Row i is prompt i.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridflow.pipeline.compiler.ir import CompiledStep, StepOutput

if TYPE_CHECKING:
    from hybridflow.config.schema import Topology
    from hybridflow.pipeline.runtime.coordinator import RunResult


@dataclass
class TrainResult:
    """What one `train`/`sft` call did. `metrics`: one dict per step (step included);
    `outputs`: each declared output -> its value per step (a metric's mean)."""

    metrics: list[dict[str, float]]
    outputs: dict[str, list[float]] = field(default_factory=dict)
    checkpoint: str = ""  # the checkpoint the call ended with
    run_dir: str = ""
    validation: list[dict[str, float]] = field(default_factory=list)  # val/ rows, step incl.


def train_result(res: RunResult, topo: Topology, compiled: CompiledStep) -> TrainResult:
    """A train/sft job's result: its metric rows, each declared output's metric per step."""
    rows = [dict(m) for m in res.metrics]
    outputs: dict[str, list[float]] = {}
    for name, out in compiled.outputs.items():
        if out.metric:
            outputs[name] = [row.get(out.metric, math.nan) for row in rows]
    return TrainResult(
        rows,
        outputs,
        res.checkpoints[-1] if res.checkpoints else "",
        str(topo.run_dir),
        validation=[dict(v) for v in res.validation],
    )


def run_outputs(
    compiled: CompiledStep,
    res: RunResult,
    step: int,
    prompts: list[str],
    tokenizer: Mapping[str, Any],
) -> dict[str, Any]:
    """{declared output: value} of the `run` step number `step` (shapes: module docstring);
    `tokenizer`: where the actor's tokenizer comes from (responses are decoded with it)."""
    collected = {k: _cat(v) for k, v in res.collected.get(step, {}).items()}
    row = res.metrics[-1] if res.metrics else {}
    n = compiled.samples_per_prompt
    return {
        name: _output(out, prompts, n, collected, row, tokenizer)
        for name, out in compiled.outputs.items()
    }


def _output(
    out: StepOutput,
    prompts: list[str],
    n: int,
    collected: dict[str, Any],
    row: Mapping[str, float],
    tokenizer: Mapping[str, Any],
) -> Any:
    """One declared output of a `run` step."""
    import torch

    if out.kind == "prompt":
        return list(prompts)
    if not out.tensor:  # a step-level value: the update's metric
        return torch.tensor(row.get(out.metric, math.nan), dtype=torch.float32)
    value = collected[out.tensor]  # [P * n, ...], prompt i's samples on rows i*n..
    if out.kind != "response":
        return value.reshape(len(prompts), n, *value.shape[1:]) if n > 1 else value
    from hybridflow.data.batching import unpad
    from hybridflow.models.loader import load_tokenizer

    tok = load_tokenizer(tokenizer.get("tokenizer"), tokenizer.get("model"))
    texts = [
        tok.decode(r, skip_special_tokens=True) for r in unpad(value, collected["response_mask"])
    ]
    return texts if n == 1 else [texts[i : i + n] for i in range(0, len(texts), n)]


def _cat(parts: Sequence[Any]) -> Any:
    from hybridflow.pipeline.runtime.scheduler import concat_rows

    return concat_rows(list(parts))

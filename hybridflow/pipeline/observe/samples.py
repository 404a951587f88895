"""Per-step samples: a few generations of every step, as text, in `<run_dir>/samples.jsonl`.

    scheduler (pure)   at each step's start `pick_rows` chooses `metrics.samples_per_step`
                       (micro-batch, row) places spread over the step; values the dataflow
                       does not declare but an op returned anyway (`SAMPLE_FIELDS`: the
                       function reward's `reward_info`, the multi-turn rollout's
                       `num_turns`) are sliced to those rows as they arrive; when the step
                       finishes, `take_rows` cuts one tensor dict per chosen row
    coordinator        hands the rows with the data source's tokenizer to the io thread
    SamplesSink        (io thread) `sample_record` decodes each row to one JSON line
    validation         the same rows of a few validation samples, split "val" (runtime/jobs/training.py)

One line per sample, the keys that the run has (a missing value leaves its key out):
    step, split ("train" | "val"), sample (sample_idx), prompt_index (group_index),
    data_source, prompt, response (decoded, special tokens skipped; without a tokenizer
    prompt_ids / response_ids instead), response_length (model tokens), reward,
    advantage (mean over the response's model tokens), ground_truth (the record's
    reward_model.ground_truth, else its answer), every scorer field in reward_info
    (acc, pred, ...), and for a multi-turn trajectory num_turns, env_reward and
    turns: [{response, tool_calls: [{name, arguments} | {error}], observation}] (the
    response's model-token runs and the observation runs after them, as response_mask
    marks them; tool calls, where a turn has any, as the run's tool parser reads it).

The sink is installed by `make_sinks` beside the jsonl sink (metrics.samples_per_step > 0)
and is a metrics sink like the others: it gets `write`/`close`, and is told apart by
`write_samples`, so it rides every path that hands sinks on (a run cut into jobs writes
one file). A resumed run keeps the lines of earlier steps, as metrics.jsonl does.

Invariants: the rows are copies (a sample keeps no micro-batch tensor alive); nothing
here runs on the event loop; a sample that cannot be decoded is written with what can be,
never raises into the run (the file is for reading, not for training).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.config.fields import METADATA, SEQUENCE_FIELDS
from hybridflow.data.batching import decode_metadata

if TYPE_CHECKING:
    from hybridflow.config.schema import Topology

log = logging.getLogger("hybridflow.samples")

SAMPLES_FILE = "samples.jsonl"
SampleRow = dict[str, torch.Tensor]  # one sample: every tensor has a leading dim of 1

# The values a sample reads, where a step has them (shapes: config/fields.py).
SAMPLE_FIELDS = (
    "sample_idx",
    "group_index",  # the prompt's number
    METADATA,  # the dataset record
    *SEQUENCE_FIELDS,  # response_mask: 1 at model tokens, 0 at observations or padding
    "rewards",
    "reward_info",  # the scorer's extras as JSON
    "advantages",
    "num_turns",  # multi-turn only
    "env_reward",  # multi-turn only
)


def pick_rows(rows_per_mb: int, n_mb: int, n: int) -> list[tuple[int, int]]:
    """`n` (micro-batch, row) places spread evenly over a step of `n_mb` micro-batches of
    `rows_per_mb` rows (the first row of each stride: with GRPO groups laid out side by
    side, different prompts when n <= the step's prompts)."""
    total = rows_per_mb * n_mb
    n = min(n, total)
    return [divmod(i * total // n, rows_per_mb) for i in range(n)]


def take_rows(
    picks: Sequence[tuple[int, int]],
    mb_values: Sequence[Mapping[str, torch.Tensor]],
    mb_extra: Sequence[Mapping[str, torch.Tensor]],
    rows_per_mb: int,
) -> list[SampleRow]:
    """One row per pick: its micro-batch's SAMPLE_FIELDS (values of `rows_per_mb` rows),
    then the extras kept for that micro-batch (already cut to its picked rows, in pick
    order). Copies, so the step's tensors can go. No response: no samples."""
    out: list[SampleRow] = []
    seen: dict[int, int] = {}  # micro-batch -> picks of it so far (index into its extras)
    for m, r in picks:
        k = seen.get(m, 0)
        seen[m] = k + 1
        row = row_of(mb_values[m], r, rows_per_mb)
        for name, v in (mb_extra[m] if m < len(mb_extra) else {}).items():
            if name not in row and k < v.shape[0]:
                row[name] = v[k : k + 1].clone()
        if "response_ids" in row:
            out.append(row)
    return out


def row_of(values: Mapping[str, torch.Tensor], r: int, rows: int) -> SampleRow:
    """Row `r` of every SAMPLE_FIELDS value of `rows` rows in `values`, copied."""
    return {
        name: v[r : r + 1].detach().cpu().clone()
        for name in SAMPLE_FIELDS
        if (v := values.get(name)) is not None and v.dim() > 0 and v.shape[0] == rows and r < rows
    }


def sample_fields_extra(
    outputs: Mapping[str, torch.Tensor], have: Iterable[str], rows: Sequence[int], size: int
) -> dict[str, torch.Tensor]:
    """The SAMPLE_FIELDS an op returned beyond what the step `have`s, cut to `rows` of its
    `size` rows (the picked rows of its micro-batch)."""
    have = set(have)
    index = torch.tensor(list(rows), dtype=torch.long)
    return {
        name: v.index_select(0, index).detach().cpu().clone()
        for name in SAMPLE_FIELDS
        if name not in have
        and (v := outputs.get(name)) is not None
        and v.dim() > 0
        and v.shape[0] == size
    }


# -- records ---------------------------------------------------------------------------
def ground_truth(meta: Mapping[str, Any]) -> Any:
    """The record's answer: verl's `reward_model.ground_truth`, else `answer` (or None)."""
    rm = meta.get("reward_model")
    if isinstance(rm, dict) and "ground_truth" in rm:
        return rm["ground_truth"]
    return meta.get("answer")


def sample_record(
    step: int,
    row: SampleRow,
    tokenizer: Any = None,
    *,
    split: str = "train",
    parser: Any = None,
) -> dict[str, Any]:
    """One sample row -> its JSON record (module docstring). `parser`: a tool-call parser
    (stages/env/parsers.py) for a multi-turn trajectory's turns; None: no tool_calls."""
    rec: dict[str, Any] = {"step": step, "split": split}
    if "sample_idx" in row:
        rec["sample"] = int(row["sample_idx"][0])
    if "group_index" in row:
        rec["prompt_index"] = int(row["group_index"][0])
    meta = _first(row, "metadata_json")
    rec["data_source"] = str(meta.get("data_source", ""))
    prompt = _ids(row, "prompt_ids", "prompt_mask")
    response = _ids(row, "response_ids", "response_mask", keep_all=True) or []
    model_mask = _mask(row, "response_mask", len(response))
    if prompt is not None:
        rec.update(_text("prompt", prompt, tokenizer))
    rec.update(
        _text("response", [t for t, m in zip(response, model_mask, strict=True) if m], tokenizer)
    )
    rec["response_length"] = sum(model_mask)
    if "rewards" in row:
        rec["reward"] = _number(row["rewards"][0])
    if "advantages" in row:
        adv = row["advantages"][0, : len(model_mask)]
        keep = torch.tensor(model_mask, dtype=torch.bool)[: adv.shape[0]]
        if bool(keep.any()):
            rec["advantage"] = _number(adv[keep].float().mean())
    truth = ground_truth(meta)
    if truth is not None:
        rec["ground_truth"] = truth
    for key, value in _first(row, "reward_info").items():
        if key not in rec:
            rec[key] = value
    if "num_turns" in row:
        rec["num_turns"] = int(row["num_turns"][0])
        if "env_reward" in row:
            rec["env_reward"] = _number(row["env_reward"][0])
        rec["turns"] = _turns(response, model_mask, tokenizer, parser)
    return rec


def _first(row: SampleRow, name: str) -> dict[str, Any]:
    if name not in row:
        return {}
    try:
        return decode_metadata(row[name])[0]
    except ValueError as exc:  # a reader's file: say what was wrong, keep the rest
        log.warning("sample %s not readable: %s", name, exc)
        return {}


def _ids(row: SampleRow, ids: str, mask: str, keep_all: bool = False) -> list[int] | None:
    if ids not in row:
        return None
    t = row[ids][0]
    if keep_all or mask not in row:
        if mask in row:  # right padding: up to the last nonzero mask position
            nz = row[mask][0].nonzero()
            t = t[: int(nz[-1]) + 1] if len(nz) else t[:0]
        return [int(x) for x in t.tolist()]
    return [int(x) for x, m in zip(t.tolist(), row[mask][0].tolist(), strict=True) if m]


def _mask(row: SampleRow, mask: str, length: int) -> list[int]:
    if mask not in row:
        return [1] * length
    return [1 if m else 0 for m in row[mask][0, :length].tolist()]


def _text(key: str, ids: list[int], tokenizer: Any) -> dict[str, Any]:
    if tokenizer is None:
        return {f"{key}_ids": ids}
    try:
        return {key: tokenizer.decode(ids, skip_special_tokens=True)}
    except Exception as exc:  # a tokenizer that cannot decode these ids: keep the ids
        log.warning("sample %s not decodable: %s: %s", key, type(exc).__name__, exc)
        return {f"{key}_ids": ids}


def _turns(
    response: list[int], model_mask: list[int], tokenizer: Any, parser: Any
) -> list[dict[str, Any]]:
    """The response's runs: model tokens (a turn) then observation tokens (its result)."""
    runs: list[tuple[int, list[int]]] = []
    for tok, m in zip(response, model_mask, strict=True):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(tok)
        else:
            runs.append((m, [tok]))
    turns: list[dict[str, Any]] = []
    for m, ids in runs:
        if m:
            turn = _text("response", ids, tokenizer)
            text = turn.get("response")
            calls = _tool_calls(parser, text) if parser and isinstance(text, str) else []
            if calls:  # none: a plain turn (or an environment that takes no tools)
                turn["tool_calls"] = calls
            turns.append(turn)
        elif turns:  # an observation follows the turn it answers
            obs = _text("observation", ids, tokenizer)
            turns[-1].update(obs)
    return turns


def _tool_calls(parser: Any, text: str) -> list[dict[str, Any]]:
    try:
        parsed = parser.parse(text)
    except Exception as exc:  # a parser is the env's: it must not stop the sample file
        log.warning("sample turn not parsed: %s: %s", type(exc).__name__, exc)
        return []
    out: list[dict[str, Any]] = []
    for item in parsed.items:
        if hasattr(item, "name"):
            out.append({"name": item.name, "arguments": item.arguments})
        else:
            out.append({"error": item.message()})
    return out


def _number(v: Any) -> float | None:
    """A finite number for JSON (None otherwise); a float32's shortest repr (0.3, not
    0.30000001192092896)."""
    x = float(v)
    if not math.isfinite(x):
        return None
    if isinstance(v, torch.Tensor) and v.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return float(f"{x:.7g}")
    return x


def tool_parser(topology: Topology | None) -> Any:
    """The tool-call parser the run's multi-turn rollout uses (its `tool_parser`, else
    its env_options' `parser`, else hermes), or None without a multi-turn rollout or when
    that parser is not registered in this process."""
    if topology is None:
        return None
    for stage in topology.stages.values():
        for rc in stage.roles.values():
            opts = rc.options
            if not opts.get("env"):
                continue
            env_opts = opts.get("env_options") or {}
            name = opts.get("tool_parser") or env_opts.get("parser") or "hermes"
            from hybridflow.errors import ConfigError
            from hybridflow.stages.env.parsers import get_parser

            try:
                return get_parser(str(name), "tool_parser")
            except ConfigError:
                return None
    return None


# -- the sink --------------------------------------------------------------------------
class SamplesSink:
    """`<run_dir>/samples.jsonl` (module docstring). A metrics sink that ignores metrics."""

    def __init__(
        self,
        run_dir: Path,
        samples_per_step: int,
        topology: Topology | None = None,
        start_step: int = 0,
    ) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / SAMPLES_FILE
        self.samples_per_step = samples_per_step
        self.parser = tool_parser(topology)
        kept = lines_before(self.path, start_step) if start_step > 0 else []
        self._f = self.path.open("w", encoding="utf-8")
        self._f.writelines(line + "\n" for line in kept)
        self._f.flush()

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        pass  # metrics are the other sinks'

    def write_samples(
        self, step: int, rows: Sequence[SampleRow], tokenizer: Any = None, split: str = "train"
    ) -> None:
        lines = []
        for row in rows[: self.samples_per_step]:
            try:
                rec = sample_record(step, row, tokenizer, split=split, parser=self.parser)
            except Exception as exc:  # never into the run: logged, the sample skipped
                log.warning("step %d: a sample not written: %s: %s", step, type(exc).__name__, exc)
                continue
            lines.append(json.dumps(rec, ensure_ascii=False, default=str) + "\n")
        self._f.writelines(lines)
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def sample_sinks(sinks: Iterable[Any]) -> list[SamplesSink]:
    """The sinks among `sinks` that take samples."""
    return [s for s in sinks if callable(getattr(s, "write_samples", None))]


def samples_wanted(sinks: Iterable[Any]) -> int:
    """How many rows a step keeps for its sample sinks (0: none)."""
    return max((int(getattr(s, "samples_per_step", 0)) for s in sample_sinks(sinks)), default=0)


def lines_before(path: Path, start_step: int) -> list[str]:
    """The lines of jsonl file `path` whose row has an int `step` < `start_step` (what a
    run resumed at `start_step` keeps); lines cut by a crash are dropped."""
    kept: list[str] = []
    if not path.is_file():
        return kept
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, int) and step < start_step:
            kept.append(line)
    return kept

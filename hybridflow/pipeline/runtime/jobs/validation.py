"""Validation: a held-out evaluation job on the run's own stage processes.

    Validator(training topology)      the validation source is read and tokenized once;
                                      its job's topology and plan are made once
      .points(start, end)             the steps at which to validate: `start` if
                                      before_train, every `interval`, `end` if after_train
      .run(session, step)             one job on the session's processes: the dataflow's
                                      generate and score ops on every validation prompt,
                                      with the sampling overrides -> the `val/` metrics
                                      row (pipeline/observe/validation.py); sample
                                      generations appended to val_generations.jsonl,
                                      and `samples` rows spread over the set kept in
                                      `.sample_rows` (samples.jsonl's "val" lines)

The validation dataflow is cut from the training one: every reward-kind role's `score`
op and, walking back, the micro-batch ops that produce its inputs (the rollout's
`generate`); nothing that trains, nothing behind a step barrier. `generate` gets the
validation's temperature / top_p / max_new_tokens as op params (the per-call sampling
overrides every rollout backend reads); the `prompts` data source repeats each prompt
`validation.n` times, in file order (no shuffle), and the score op also returns
`reward_info` (a scorer's `acc`, `pred`) when its backend declares it. A multi-turn
rollout (one whose generate makes `num_turns`) runs its environment here too, and each
sample adds `turns` and `multi_turn` (1 when the trajectory went past its first turn:
with a ToolEnv, when the model called a tool) to its extras, so the row has
`val/<data_source>/turns/mean` and the tool-use rate `val/<data_source>/multi_turn/mean`.

Sizes: a micro-batch holds whole prompts (validation.micro_batch, else run.micro_batch
rounded down to a multiple of n); a job step holds at most run.step_batch samples
(rounded to whole micro-batches), and the last step's rows past the set's end wrap
around into a second epoch: they are generated and dropped (by `sample_idx`), so every
prompt counts exactly once.

Invariants: validation never changes a role's weights, optimizer or the run's step; the
same policy and settings give the same metrics (the rollout seeds from (seed, job step,
micro-batch), and the set is read in order); a task: source is generated with a seed
apart from the training data's, so it is held out.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from hybridflow.config.fields import GROUP_INDEX, METADATA, SAMPLE_INDEX
from hybridflow.config.schema import (
    DRIVER_ROLE,
    NO_METRICS,
    DataConfig,
    OpConfig,
    RunConfig,
    Topology,
    ValidationConfig,
)
from hybridflow.data.batching import decode_metadata, unpad
from hybridflow.errors import ConfigError, PipelineError
from hybridflow.pipeline.observe.samples import SampleRow, ground_truth, lines_before, row_of
from hybridflow.pipeline.observe.validation import ValSample, validation_metrics
from hybridflow.pipeline.plan.planner import Plan, build_plan, role_classes
from hybridflow.pipeline.sources.registry import create_source

GENERATIONS_FILE = "val_generations.jsonl"
VAL_SEED_OFFSET = 7919  # task: sources are generated from seed + this (held out)
_DATA_FIELDS = (METADATA, GROUP_INDEX, SAMPLE_INDEX)  # the source's record of each row
_DEFAULT_TASK_PROMPTS = 256


def validation_ops(topo: Topology) -> tuple[OpConfig, ...]:
    """The training dataflow cut down to what scoring needs (module docstring)."""
    cfg = topo.validation
    assert cfg is not None
    classes = role_classes(topo)
    kinds = {
        role: rc.kind_of(role) for stage in topo.stages.values() for role, rc in stage.roles.items()
    }
    scores = {
        i
        for i, op in enumerate(topo.dataflow)
        if op.role != DRIVER_ROLE and kinds.get(op.role) == "reward" and op.op == "score"
    }
    if not scores:
        raise ConfigError(
            "validation",
            "the dataflow has no reward `score` op to validate with (a role of kind reward)",
        )
    keep, needed = set(scores), set()
    for i in reversed(range(len(topo.dataflow))):
        op = topo.dataflow[i]
        if i not in keep and not set(op.outputs) & needed:
            continue
        if op.scope == "step":
            raise ConfigError(
                f"dataflow[{i}]",
                f"{op.label} is a step op, but the reward score op needs its outputs "
                f"{sorted(set(op.outputs) & needed)}: validation runs micro-batch ops only",
            )
        keep.add(i)
        needed |= set(op.inputs)
    out = []
    for i in sorted(keep):
        op = topo.dataflow[i]
        if op.op == "generate":
            params = dict(op.params, temperature=cfg.temperature, top_p=cfg.top_p)
            if cfg.max_new_tokens is not None:
                params["max_new_tokens"] = cfg.max_new_tokens
            if "n" in params:  # the data source repeats each prompt validation.n times
                params["n"] = 1
            op = dataclasses.replace(op, params=params)
        if i in scores:
            spec = getattr(classes.get(op.role), "find_op", lambda _: None)(op.op)
            declared = spec.outputs if spec is not None else ()
            if declared and "reward_info" in declared and "reward_info" not in op.outputs:
                op = dataclasses.replace(op, outputs=(*op.outputs, "reward_info"))
        out.append(op)
    return tuple(out)


def _data_config(topo: Topology, cfg: ValidationConfig) -> DataConfig:
    if topo.data.source != "prompts":
        raise ConfigError(
            "validation.source",
            f"validation reads prompts through the `prompts` data source; this run's "
            f"data.source is {topo.data.source!r}",
        )
    if cfg.source.startswith("memory:"):
        raise ConfigError("validation.source", "give a file, a directory or task:NAME")
    options = dict(topo.data.options)
    options.update(source=cfg.source, samples_per_prompt=cfg.n, shuffle=False)
    options.pop("task_size", None)
    if cfg.source.startswith("task:"):
        options["task_size"] = cfg.max_prompts or _DEFAULT_TASK_PROMPTS
    elif cfg.max_prompts:
        options["limit"] = cfg.max_prompts
    if cfg.split is not None:
        options["split"] = cfg.split
    fields = tuple(dict.fromkeys((*topo.data.fields, *_DATA_FIELDS)))
    return DataConfig(source="prompts", fields=fields, options=options)


def _sizes(cfg: ValidationConfig, run: RunConfig, samples: int) -> RunConfig:
    n = cfg.n
    mb = cfg.micro_batch or max(n, run.micro_batch // n * n)
    per_step = max(mb, run.step_batch // mb * mb)
    per_step = min(per_step, math.ceil(samples / mb) * mb)
    return RunConfig(
        steps=math.ceil(samples / per_step),
        step_batch=per_step,
        micro_batch=mb,
        max_offpolicy_steps=0,
        mode="streamed",
        max_inflight=run.max_inflight,
    )


class Validator:
    """Held-out evaluation of one training topology (module docstring)."""

    def __init__(
        self, topo: Topology, run_dir: Path, *, generations_file: str = GENERATIONS_FILE
    ) -> None:
        cfg = topo.validation
        if cfg is None:
            raise ConfigError("validation", "the topology has no validation: section")
        self.cfg, self.run_dir = cfg, run_dir
        self.generations_path = run_dir / generations_file
        ops = validation_ops(topo)
        data = _data_config(topo, cfg)
        try:
            self.source = create_source(data, topo.seed + VAL_SEED_OFFSET)
        except ConfigError as exc:  # the data source names its own option keys
            key = "validation.source" if exc.path == "data.options.source" else exc.path
            raise ConfigError(
                key, f"(the validation set) {str(exc).removeprefix(f'{exc.path}: ')}"
            ) from None
        try:
            count = self.source.prompt_count()
            if not count:
                raise ConfigError("validation.source", f"{cfg.source!r} holds no prompts")
            self.prompts = count
            self.samples = count * cfg.n
            self.topology = dataclasses.replace(
                topo,
                name=f"{topo.name}-val",
                dataflow=ops,
                data=data,
                run=_sizes(cfg, topo.run, self.samples),
                metrics=NO_METRICS,
                checkpoint=None,
                validation=None,
            )
            # The source above is the plan's data check (built from the same `data`):
            # the plan does not build, and tokenize, the validation set again.
            self.plan: Plan = build_plan(self.topology, check_data=False)
        except BaseException:
            self.source.close()
            raise
        self.tokenizer = self.source.tokenizer
        self.collect = tuple(
            dict.fromkeys(
                (
                    "sample_idx",
                    "group_index",
                    "metadata_json",
                    "rewards",
                    "response_ids",
                    "response_mask",
                    *(("reward_info",) if self._has("reward_info") else ()),
                    *(("num_turns",) if self._has("num_turns") else ()),
                    *(("env_reward",) if self._has("env_reward") else ()),  # for the samples
                    "prompt_ids",  # for the generations file and the samples
                    "prompt_mask",
                )
            )
        )
        self.rows: list[dict[str, float]] = []
        self.sample_rows: list[SampleRow] = []  # the last run's, for samples.jsonl

    def begin(self, start_step: int) -> None:
        """A fresh run (start 0) starts the generations file anew; a resumed one keeps
        the lines of earlier steps, as metrics.jsonl does."""
        path = self.generations_path
        if not path.is_file():
            return
        kept = lines_before(path, start_step) if start_step > 0 else []
        path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def _has(self, value: str) -> bool:
        return any(value in op.outputs for op in self.topology.dataflow)

    def points(self, start: int, end: int) -> list[int]:
        """The steps in [start, end] at which to validate, in order."""
        cfg, out = self.cfg, set()
        if cfg.before_train:
            out.add(start)
        if cfg.interval:  # the multiples of interval after start
            out.update(range(start - start % cfg.interval + cfg.interval, end + 1, cfg.interval))
        if cfg.after_train:
            out.add(end)
        return sorted(p for p in out if start <= p <= end)

    def run(self, session: Any, step: int, samples: int = 0) -> tuple[dict[str, float], Any]:
        """Evaluate the policy the processes hold now; -> its `val/` row (logged at
        `step`: the policy after `step` updates) and the job's RunResult. `samples`: how
        many sample rows, spread over the set, to keep in `self.sample_rows`."""
        t0 = time.perf_counter()
        res = session.run_job(
            self.plan, collect=self.collect, sinks=[], start_step=0, source=self.source
        )
        scored, rows = self._samples(res.collected, samples)
        metrics = validation_metrics(scored, self.cfg.n)
        metrics["val/time_s"] = time.perf_counter() - t0 - res.startup_s  # not the launch
        if self.cfg.generations:
            self._write_generations(step, rows[: self.cfg.generations])
        self.rows.append({"step": float(step), **metrics})
        return metrics, res

    def _samples(
        self, collected: dict[int, dict[str, list[torch.Tensor]]], keep: int = 0
    ) -> tuple[list[ValSample], list[dict[str, Any]]]:
        """Collected tensors -> one ValSample per validation sample (wrapped rows
        dropped), and the raw per-sample fields the generations file needs; `keep`
        sample rows spread over the set go to `self.sample_rows`."""
        samples: dict[int, ValSample] = {}
        raw: dict[int, dict[str, Any]] = {}
        keep = min(keep, self.samples)
        wanted = {i * self.samples // keep for i in range(keep)} if keep else set()
        kept: dict[int, SampleRow] = {}
        for step in sorted(collected):
            values = collected[step]
            for m in range(len(values["rewards"])):
                part = {k: v[m] for k, v in values.items()}
                meta = decode_metadata(part["metadata_json"])
                info = (
                    decode_metadata(part["reward_info"])
                    if "reward_info" in part
                    else [{} for _ in meta]
                )
                lengths = part["response_mask"].sum(dim=1).tolist()
                for r, k in enumerate(part["sample_idx"].tolist()):
                    if k >= self.samples or k in samples:
                        continue  # a wrapped row of the last step
                    extras = {
                        key: (float(v) if isinstance(v, int | float) else v)
                        for key, v in info[r].items()
                        if isinstance(v, int | float | str) and not isinstance(v, bool)
                    }
                    if "num_turns" in part:  # a multi-turn rollout's trajectory
                        turns = int(part["num_turns"][r])
                        extras.update(turns=float(turns), multi_turn=float(turns > 1))
                    samples[k] = ValSample(
                        prompt=int(part["group_index"][r]),
                        data_source=str(meta[r].get("data_source", "")),
                        reward=float(part["rewards"][r]),
                        response_length=int(lengths[r]),
                        extras=extras,
                    )
                    if self.cfg.generations and len(raw) < self.cfg.generations:
                        raw[k] = {"part": part, "row": r, "meta": meta[r]}
                    if k in wanted:
                        kept[k] = row_of(part, r, len(part["rewards"]))
        missing = self.samples - len(samples)
        if missing:
            raise PipelineError(
                "validation", f"{missing} of {self.samples} validation samples came back unscored"
            )
        self.sample_rows = [kept[k] for k in sorted(kept)]
        return [samples[k] for k in sorted(samples)], [raw[k] | {"k": k} for k in sorted(raw)]

    def _write_generations(self, step: int, rows: list[dict[str, Any]]) -> None:
        decode = self.tokenizer.decode
        lines = []
        for item in rows:
            part, r, meta = item["part"], item["row"], item["meta"]
            prompt = unpad(part["prompt_ids"][r : r + 1], part["prompt_mask"][r : r + 1])[0]
            resp = unpad(part["response_ids"][r : r + 1], part["response_mask"][r : r + 1])[0]
            info = (
                decode_metadata(part["reward_info"][r : r + 1])[0] if "reward_info" in part else {}
            )
            record = {
                "step": step,
                "sample": item["k"],
                "prompt_index": int(part["group_index"][r]),
                "data_source": meta.get("data_source", ""),
                "prompt": decode(prompt, skip_special_tokens=True),
                "response": decode(resp, skip_special_tokens=True),
                "reward": float(part["rewards"][r]),
                **({"ground_truth": ground_truth(meta)} if ground_truth(meta) is not None else {}),
                **{k: v for k, v in info.items() if k not in ("step", "reward")},
            }
            lines.append(json.dumps(record, ensure_ascii=False) + "\n")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self.generations_path.open("a", encoding="utf-8") as f:
            f.writelines(lines)

    def close(self) -> None:
        self.source.close()

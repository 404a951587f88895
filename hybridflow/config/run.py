"""What a run does: its sizes and overlap (`run:`), its training data (`data:`) and its
held-out evaluation (`validation:`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from hybridflow.config.checks import (
    IDENT,
    MAX_INFLIGHT,
    MAX_MICRO_BATCHES,
    MAX_OFFPOLICY_STEPS,
    MAX_STEP_BATCH,
    at_least,
    at_most,
    join,
    require,
)
from hybridflow.errors import ConfigError


@dataclass(frozen=True)
class RunConfig:
    """How long and how wide a run is, and how much the steps may overlap."""

    steps: int = 1  # RL steps of the run (a resumed run continues up to this many)
    step_batch: int = 8  # samples (rows from the data source) per step
    micro_batch: int = 8  # samples per micro-batch: the unit of streaming
    # 0 = strict on-policy: rollout of step s+1 waits for the step-s reshard.
    # k > 0: step s may start once policy version s-k exists (rollout runs k versions ahead).
    max_offpolicy_steps: int = 0
    # streamed: micro-batch pipelining; sequential: each phase finishes the whole step first.
    mode: Literal["streamed", "sequential"] = "streamed"
    max_inflight: int = 2  # tasks queued or running per stage replica (>= 2 hides latency)

    @property
    def micro_batches(self) -> int:
        return self.step_batch // self.micro_batch

    def validate(self, path: str) -> None:
        for key in ("steps", "step_batch", "micro_batch", "max_inflight"):
            at_least(getattr(self, key), 1, join(path, key))
        at_least(self.max_offpolicy_steps, 0, join(path, "max_offpolicy_steps"))
        at_most(self.step_batch, MAX_STEP_BATCH, join(path, "step_batch"), "samples held per step")
        at_most(self.max_inflight, MAX_INFLIGHT, join(path, "max_inflight"), "tasks per replica")
        at_most(
            self.step_batch // self.micro_batch,
            MAX_MICRO_BATCHES,
            join(path, "micro_batch"),
            "micro-batches per step = run.step_batch / run.micro_batch; raise micro_batch",
        )
        at_most(
            self.max_offpolicy_steps,
            MAX_OFFPOLICY_STEPS,
            join(path, "max_offpolicy_steps"),
            "steps in flight at once, each holding its samples",
        )
        if self.step_batch % self.micro_batch:
            divisors = [d for d in range(1, self.step_batch + 1) if self.step_batch % d == 0]
            raise ConfigError(
                join(path, "micro_batch"),
                f"{self.micro_batch} does not divide run.step_batch {self.step_batch}; "
                f"use one of {', '.join(map(str, divisors[:12]))}",
            )
        require(
            self.mode != "sequential" or not self.max_offpolicy_steps,
            join(path, "max_offpolicy_steps"),
            "must be 0 when run.mode is 'sequential' (steps never overlap there), "
            f"got {self.max_offpolicy_steps}",
        )


@dataclass(frozen=True)
class DataConfig:
    """Where prompts come from. `source` names a registered data source (see
    hybridflow.pipeline.sources.registry); `fields` are the per-sample values it provides,
    which the dataflow may consume."""

    source: str = "synthetic"  # a registered data source: prompts | sft | synthetic
    fields: tuple[str, ...] = ("prompt_ids",)  # per-sample values it provides to the dataflow
    options: dict[str, Any] = field(default_factory=dict)  # the source's own options

    def validate(self, path: str) -> None:
        require(bool(self.fields), join(path, "fields"), "must name at least one value")
        for i, name in enumerate(self.fields):
            require(
                bool(IDENT.match(name)),
                f"{path}.fields[{i}]",
                f"{name!r} is not a valid value name (letters, digits, _)",
            )
        require(len(set(self.fields)) == len(self.fields), join(path, "fields"), "has duplicates")


@dataclass(frozen=True)
class ValidationConfig:
    """Held-out evaluation between training steps (pipeline/runtime/jobs/validation.py).

    The same stage processes run the dataflow's generate and score ops (no update) on
    `source`, read through the training data source's options (tokenizer, prompt_key,
    chat template, ...), with the sampling overrides below; the metrics carry a `val/`
    prefix and go to the run's sinks at the step they describe (the policy after that
    many updates): `val/reward/mean`, `val/<data_source>/<metric>/mean` for the reward and
    each scorer metric, with n > 1 also `mean@n`, `best@n` and (when the scorer returns
    `pred`) `maj@n`; `val/response_length/mean`."""

    source: str = ""  # a .jsonl / .json / .parquet file, a datasets directory, task:NAME
    interval: int = 0  # steps between validations; 0: only before/after training
    before_train: bool = True  # validate the initial policy (verl's val_before_train)
    after_train: bool = True  # and the final one
    max_prompts: int = 0  # the first N prompts of the source; 0: all of them
    temperature: float = 0.0  # 0 = greedy (verl's val_kwargs default)
    top_p: float = 1.0  # nucleus sampling override; 1 = off
    n: int = 1  # samples per prompt; > 1 needs temperature > 0
    max_new_tokens: int | None = None  # None: the rollout's own
    micro_batch: int = 0  # samples per micro-batch; 0: run.micro_batch (a multiple of n)
    generations: int = 0  # samples written to <run_dir>/val_generations.jsonl per validation
    split: str | None = None  # for a datasets directory with several splits

    def validate(self, path: str) -> None:
        require(
            bool(self.source),
            join(path, "source"),
            "is required: a file, a directory or task:NAME",
        )
        for key in ("interval", "max_prompts", "micro_batch", "generations"):
            at_least(getattr(self, key), 0, join(path, key))
        at_least(self.n, 1, join(path, "n"))
        at_least(self.temperature, 0, join(path, "temperature"))
        require(0 < self.top_p <= 1, join(path, "top_p"), f"must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens is not None:
            at_least(self.max_new_tokens, 1, join(path, "max_new_tokens"))
        if self.n > 1 and self.temperature == 0:
            raise ConfigError(
                join(path, "n"),
                f"is {self.n}, but greedy decoding (temperature 0) gives {self.n} identical "
                "samples; set validation.temperature > 0 for mean@n / best@n / maj@n",
            )
        if self.micro_batch and self.micro_batch % self.n:
            raise ConfigError(
                join(path, "micro_batch"),
                f"{self.micro_batch} is not a multiple of validation.n {self.n} "
                "(a prompt's samples stay in one micro-batch)",
            )

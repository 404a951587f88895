"""Data sources: where each step's samples come from (the `data:` section of a topology).

A source is asked for one step at a time: `batch(step, size)` returns a flat dict of
tensors with exactly the configured `fields`, `size` rows each (batch dimension first).
The coordinator calls it in an executor thread (never on the event loop) and splits the
rows into micro-batches.

Invariants:
  - deterministic in `(seed, step)`: re-running or resuming at step s yields the same rows
    (the checkpoint's "data position" is just the step number);
  - sources are registered by name -> "module:Class" and imported only when used, so the
    RL/data code (hybridflow.data) can add datasets without the runtime importing them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from hybridflow.config.fields import PROMPT_FIELDS, SAMPLE_INDEX
from hybridflow.config.imports import load_attr
from hybridflow.config.schema import DataConfig
from hybridflow.errors import ConfigError

Batch = dict[str, torch.Tensor]


class DataSource(Protocol):
    def batch(self, step: int, size: int) -> Batch:
        """The `size` samples of `step`, as named tensors (dim 0 = samples)."""
        ...

    def close(self) -> None: ...


# name -> "module:Class"; the class is constructed as Class(fields, options, seed) and
# validates its own options, raising ConfigError("data.options.<key>", ...).
SOURCES: dict[str, str] = {
    "synthetic": "hybridflow.pipeline.sources.registry:SyntheticPrompts",
    "prompts": "hybridflow.pipeline.sources.rl:GroupedPrompts",  # datasets / tasks for RL
    "sft": "hybridflow.pipeline.sources.sft:SFTExamples",  # (prompt, response) pairs for SFT
}


def register_source(name: str, target: str) -> None:
    SOURCES[name] = target


def source_class(cfg: DataConfig) -> Any:
    target = SOURCES.get(cfg.source)
    if target is None:
        raise ConfigError(
            "data.source",
            f"unknown data source {cfg.source!r}; known: {', '.join(sorted(SOURCES))}",
        )
    return load_attr(target, "data.source")


def create_source(cfg: DataConfig, seed: int) -> DataSource:
    return source_class(cfg)(tuple(cfg.fields), dict(cfg.options), seed)


def check_fields(fields: tuple[str, ...], provides: tuple[str, ...], source: str) -> None:
    """Every name of `data.fields` is one the `source` source provides; else a
    ConfigError at `data.fields[i]` listing what it does provide."""
    for i, name in enumerate(fields):
        if name not in provides:
            raise ConfigError(
                f"data.fields[{i}]",
                f"the {source} source cannot provide {name!r}; it provides {', '.join(provides)}",
            )


def _int_option(options: Mapping[str, Any], key: str, default: int, low: int) -> int:
    value = options.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"data.options.{key}", f"must be an int >= {low}, got {value!r}")
    return value


class SyntheticPrompts:
    """Random prompt token ids, for benchmarks and runtime tests (no tokenizer, no file).

    Fields it can provide:
      prompt_ids   # [B, prompt_length] int64 in [0, vocab_size)
      prompt_mask  # [B, prompt_length] int64, all ones
      sample_idx   # [B] int64, global sample number: step * step_batch + row
    Options: prompt_length (8), vocab_size (1000).
    """

    FIELDS = (*PROMPT_FIELDS, SAMPLE_INDEX)

    def __init__(self, fields: tuple[str, ...], options: Mapping[str, Any], seed: int) -> None:
        unknown = sorted(set(options) - {"prompt_length", "vocab_size"})
        if unknown:
            raise ConfigError(
                f"data.options.{unknown[0]}", "unknown option; known: prompt_length, vocab_size"
            )
        check_fields(fields, self.FIELDS, "synthetic")
        self.fields = fields
        self.prompt_length = _int_option(options, "prompt_length", 8, 1)
        self.vocab_size = _int_option(options, "vocab_size", 1000, 2)
        self.seed = seed

    def batch(self, step: int, size: int) -> Batch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        ids = torch.randint(0, self.vocab_size, (size, self.prompt_length), generator=g)
        all_fields = {
            "prompt_ids": ids,
            "prompt_mask": torch.ones_like(ids),
            SAMPLE_INDEX: torch.arange(step * size, (step + 1) * size, dtype=torch.int64),
        }
        return {name: all_fields[name] for name in self.fields}

    def close(self) -> None:
        pass

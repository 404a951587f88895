"""The `sft` data source: supervised (prompt, response) pairs for the actor's `sft_update`.

Records come from a built-in task (`task:NAME`: the task's ideal responses) or a file /
datasets directory whose rows hold `prompt` and `response` strings (keys configurable).
Each step is `size` pairs in a seeded order, collated to the RL batch layout
(hybridflow.data.batching.collate_sft), so SFT is the same actor on the same tensors:

  prompt_ids     [B, P] int64  left-padded        prompt_mask    [B, P] int64
  response_ids   [B, R] int64  right-padded, EOS  response_mask  [B, R] int64
  sample_idx     [B] int64     global sample number: step * B + row

Options: source (required), tokenizer ("builtin" / a directory) or model (use that
model's tokenizer), task_size (pairs generated for task sources, 1024), prompt_key
("prompt"), response_key ("response"), shuffle (true).

Invariant: deterministic in (seed, step), like the RL prompt sources: row k of the run
is row k mod N of the seeded permutation of epoch k // N, so a resumed run continues
exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.config.loader import from_dict
from hybridflow.data.batching import collate_sft
from hybridflow.data.prompts import epoch_order
from hybridflow.data.sources import load_records
from hybridflow.errors import ConfigError

Batch = dict[str, torch.Tensor]


@dataclass
class SFTOptions:
    source: str = ""
    tokenizer: str | None = None
    model: str | None = None
    task_size: int = 1024
    prompt_key: str = "prompt"
    response_key: str = "response"
    shuffle: bool = True

    def validate(self, path: str) -> None:
        if not self.source:
            raise ConfigError(f"{path}.source", "is required: a file, a directory or task:NAME")
        if self.tokenizer is None and self.model is None:
            raise ConfigError(
                f"{path}.tokenizer", "is required: 'builtin', a tokenizer directory, or set `model`"
            )
        if self.task_size < 1:
            raise ConfigError(f"{path}.task_size", f"must be >= 1, got {self.task_size}")


class SFTExamples:
    FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "sample_idx")

    def __init__(self, fields: tuple[str, ...], options: Mapping[str, Any], seed: int) -> None:
        from hybridflow.models.loader import load_tokenizer

        for i, name in enumerate(fields):
            if name not in self.FIELDS:
                raise ConfigError(
                    f"data.fields[{i}]",
                    f"the sft source cannot provide {name!r}; it provides {', '.join(self.FIELDS)}",
                )
        opts = from_dict(SFTOptions, dict(options), "data.options")
        self.fields, self.seed, self.shuffle = fields, seed, opts.shuffle
        self.tokenizer = load_tokenizer(opts.tokenizer, opts.model, "data.options.tokenizer")
        if opts.source.startswith("task:"):
            from hybridflow.data.tasks import TASKS

            name = opts.source.removeprefix("task:")
            if name not in TASKS:
                raise ConfigError(
                    "data.options.source",
                    f"unknown built-in task {name!r}; known: {', '.join(TASKS)}",
                )
            records = TASKS[name].sft_examples(opts.task_size, seed)
            pk, rk = "prompt", "response"
        else:
            records = load_records(opts.source, path="data.options.source")
            pk, rk = opts.prompt_key, opts.response_key
        self.pairs = []
        for i, rec in enumerate(records):
            p, r = rec.get(pk), rec.get(rk)
            if not isinstance(p, str) or not isinstance(r, str):
                raise ConfigError(
                    "data.options.source",
                    f"row {i} needs string fields {pk!r} and {rk!r} (has {sorted(rec)})",
                )
            self.pairs.append({"prompt": p, "response": r})
        if not self.pairs:
            raise ConfigError("data.options.source", f"{opts.source!r} holds no records")
        self._orders: dict[int, list[int]] = {}

    def _row(self, k: int) -> int:
        n = len(self.pairs)
        epoch, pos = divmod(k, n)
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                del self._orders[min(self._orders)]
            self._orders[epoch] = epoch_order(n, self.seed, epoch, self.shuffle)
        return self._orders[epoch][pos]

    def batch(self, step: int, size: int) -> Batch:
        first = step * size
        out = collate_sft(
            [self.pairs[self._row(k)] for k in range(first, first + size)], self.tokenizer
        )
        out["sample_idx"] = torch.arange(first, first + size, dtype=torch.int64)
        return {name: out[name] for name in self.fields}

    def close(self) -> None:
        pass

"""`PromptSource`: the runtime's data-source interface over real prompt datasets.

The pipeline asks a data source for one step at a time (`hybridflow.pipeline.sources.registry`):
`PromptSource(fields, options, seed).batch(step, size)` returns `size` rows of the
configured fields. This class serves a `PromptDataset` (a file, a datasets directory or a
built-in task, loaded and tokenized whole: small next to rollout cost) or an in-memory
dataset given to the Python API (`memory:N`, hybridflow.data.memory: a torch or Hugging
Face dataset, read and tokenized a step at a time) through that interface.

Fields it can provide:
  prompt_ids     [B, P] int64   left-padded with the tokenizer's pad id (P = longest row)
  prompt_mask    [B, P] int64
  metadata_json  [B, L] uint8   per-sample metadata as JSON (see data/batching.py): the
                                record's other fields (e.g. `answer`, `id`) and `index`
                                (the dataset row; for a stream, the record's number in
                                the run)
  sample_idx     [B] int64      global sample number: step * size + row

Options: every `DataOptions` field (source, prompt_key, max_prompt_length, truncation,
chat_template, split, task_size, shuffle) plus `tokenizer` ("builtin" or a directory) or
`model` (use that model's tokenizer).

Invariant: deterministic in (seed, step): sample k of the run is row k mod N of the
seeded permutation of epoch k // N (N = dataset size), so a resumed run needs nothing
but the step number to continue exactly where it stopped. A stream (an iterable
dataset) has no N and no random access: sample k is its k-th record (`shuffle` does not
apply; shuffle the stream itself), found again on resume as data/memory.py describes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.config.fields import METADATA, PROMPT_FIELDS, SAMPLE_INDEX
from hybridflow.config.loader import from_dict
from hybridflow.data import memory
from hybridflow.data.batching import collate_prompts
from hybridflow.data.prompts import (
    DataOptions,
    PromptDataset,
    PromptItem,
    epoch_order,
    make_item,
    uses_template,
)
from hybridflow.errors import ConfigError
from hybridflow.models.loader import load_tokenizer
from hybridflow.pipeline.sources.registry import check_fields

Batch = dict[str, torch.Tensor]


@dataclass
class PromptSourceOptions(DataOptions):
    tokenizer: str | None = None  # "builtin" or a tokenizer directory
    model: str | None = None  # or: use this model's tokenizer (directory or preset)


class PromptSource:
    FIELDS = (*PROMPT_FIELDS, METADATA, SAMPLE_INDEX)

    def __init__(self, fields: tuple[str, ...], options: Mapping[str, Any], seed: int) -> None:
        check_fields(fields, self.FIELDS, "prompts")
        opts = from_dict(PromptSourceOptions, dict(options), "data.options")
        if opts.tokenizer is None and opts.model is None:
            raise ConfigError(
                "data.options.tokenizer",
                "is required to tokenize prompts: 'builtin', a tokenizer directory, or set `model`",
            )
        self.fields, self.seed, self.shuffle = fields, seed, opts.shuffle
        self.tokenizer = load_tokenizer(opts.tokenizer, opts.model, "data.options.tokenizer")
        self.opts, self._template = opts, uses_template(self.tokenizer, opts)
        # Exactly one of: a loaded dataset, or an in-memory one read on demand.
        self.dataset: PromptDataset | None = None
        self.records: memory.MapRecords | memory.StreamRecords | None = None
        if memory.is_handle(opts.source):
            self.records = memory.lookup(opts.source, "data.options.source")
        else:
            self.dataset = PromptDataset.load(opts, self.tokenizer, seed=seed, path="data.options")
        self._orders: dict[int, list[int]] = {}

    def prompt_count(self) -> int | None:
        """Records in one epoch; None for a stream (an iterable dataset has no length)."""
        if self.dataset is not None:
            return len(self.dataset)
        return len(self.records) if isinstance(self.records, memory.MapRecords) else None

    def _item(self, k: int, rec: dict[str, Any]) -> PromptItem:
        return make_item(k, rec, self.tokenizer, self.opts, self._template, "data.options")

    def _at(self, row: int) -> PromptItem:
        if self.dataset is not None:
            return self.dataset[row]
        assert isinstance(self.records, memory.MapRecords)
        return self._item(row, self.records.record(row))

    def _row(self, k: int) -> int:
        source = self.dataset if self.dataset is not None else self.records
        assert isinstance(source, PromptDataset | memory.MapRecords)
        n = len(source)
        epoch, pos = divmod(k, n)
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # steps move forward: two epochs cover any batch
                del self._orders[min(self._orders)]
            self._orders[epoch] = epoch_order(n, self.seed, epoch, self.shuffle)
        return self._orders[epoch][pos]

    def batch(self, step: int, size: int) -> Batch:
        first = step * size
        if isinstance(self.records, memory.StreamRecords):
            recs = self.records.read(first, size)
            items = [self._item(first + j, rec) for j, rec in enumerate(recs)]
        else:
            items = [self._at(self._row(k)) for k in range(first, first + size)]
        out = collate_prompts(items, self.tokenizer.pad_token_id)
        out[SAMPLE_INDEX] = torch.arange(first, first + size, dtype=torch.int64)
        return {name: out[name] for name in self.fields}

    def close(self) -> None:
        pass

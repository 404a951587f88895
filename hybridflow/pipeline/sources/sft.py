"""The `sft` data source: supervised (prompt, response) pairs for the actor's `sft_update`.

Records come from a built-in task (`task:NAME`: the task's ideal responses) or a file /
datasets directory whose rows hold a prompt and a response (keys configurable). The
prompt is a string or a list of chat messages, as in the RL prompt source; a verl RL
record (`prompt`: messages, the worked solution at `extra_info.answer`) works as is with
`response_key: extra_info.answer` (a dotted path into nested fields).
Each step is `size` pairs in a seeded order, collated to the RL batch layout
(hybridflow.data.batching.collate_sft), so SFT is the same actor on the same tensors:

  prompt_ids     [B, P] int64  left-padded        prompt_mask    [B, P] int64
  response_ids   [B, R] int64  right-padded, EOS  response_mask  [B, R] int64
  sample_idx     [B] int64     global sample number: step * B + row

A response is text (tokenized, EOS appended) or a list of token ids taken as they are:
a multi-turn demonstration rendered as the trajectory loop lays it out (model turns,
each ending on its stop token, with the tool observations between them), whose
`response_mask` (a list of 0/1, one per id; all 1 when absent) is 0 on the observation
tokens, so SFT trains on the model's tokens only, as RL's loss does (examples/agent_math.py).

Options: source (required), tokenizer ("builtin" / a directory) or model (use that
model's tokenizer), task_size (pairs generated for task sources, 1024), prompt_key
("prompt"), response_key ("response"; dotted: "extra_info.answer"), response_mask_key
("response_mask"), chat_template
("auto" | "never"), max_prompt_length (256), truncation ("error"), split, shuffle (true).

Invariants:
  - a prompt becomes exactly the token ids the RL prompt source gives the same record
    with the same options: both go through data/prompts.py `make_item` (chat template
    when the tokenizer has one and chat_template is "auto"; the same length check), so
    a policy fine-tuned here is trained on the prompts RL will sample it on;
  - deterministic in (seed, step), like the RL prompt sources: row k of the run is row
    k mod N of the seeded permutation of epoch k // N, so a resumed run continues
    exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hybridflow.config.fields import SAMPLE_INDEX, SEQUENCE_FIELDS
from hybridflow.config.loader import from_dict
from hybridflow.data.batching import collate_sft
from hybridflow.data.prompts import DataOptions, epoch_order, make_item, uses_template
from hybridflow.data.sources import load_records
from hybridflow.errors import ConfigError
from hybridflow.pipeline.sources.registry import check_fields

Batch = dict[str, torch.Tensor]


@dataclass
class SFTOptions:
    source: str = ""  # .jsonl / .json / .parquet / datasets directory / task:NAME
    tokenizer: str | None = None  # "builtin" or a tokenizer directory
    model: str | None = None  # or: use this model's tokenizer (directory or preset)
    task_size: int = 1024  # pairs generated for task:NAME sources
    prompt_key: str = "prompt"  # a string, or a list of {role, content} chat messages
    response_key: str = "response"  # a field name, or a dotted path: "extra_info.answer"
    response_mask_key: str = "response_mask"  # with token-id responses (module docstring)
    chat_template: Literal["auto", "never"] = "auto"  # as DataOptions: the RL prompts'
    max_prompt_length: int = 256  # tokens; as DataOptions
    truncation: Literal["error", "left", "right"] = "error"  # as DataOptions
    split: str | None = None  # for a datasets directory with several splits
    shuffle: bool = True  # a seeded new order every epoch; False: the source's order

    def validate(self, path: str) -> None:
        if not self.source:
            raise ConfigError(f"{path}.source", "is required: a file, a directory or task:NAME")
        if self.tokenizer is None and self.model is None:
            raise ConfigError(
                f"{path}.tokenizer", "is required: 'builtin', a tokenizer directory, or set `model`"
            )
        if self.task_size < 1:
            raise ConfigError(f"{path}.task_size", f"must be >= 1, got {self.task_size}")
        if self.max_prompt_length < 1:
            raise ConfigError(f"{path}.max_prompt_length", "must be >= 1")

    def prompt_options(self) -> DataOptions:
        """The RL prompt options these stand for (make_item's view of them)."""
        return DataOptions(
            source=self.source,
            prompt_key=self.prompt_key,
            max_prompt_length=self.max_prompt_length,
            truncation=self.truncation,
            chat_template=self.chat_template,
        )


class SFTExamples:
    FIELDS = (*SEQUENCE_FIELDS, SAMPLE_INDEX)

    def __init__(self, fields: tuple[str, ...], options: Mapping[str, Any], seed: int) -> None:
        from hybridflow.models.loader import load_tokenizer

        check_fields(fields, self.FIELDS, "sft")
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
            opts.prompt_key, opts.response_key = "prompt", "response"
        else:
            records = load_records(opts.source, split=opts.split, path="data.options.source")
        if not records:
            raise ConfigError("data.options.source", f"{opts.source!r} holds no records")
        prompt_opts = opts.prompt_options()
        template = uses_template(self.tokenizer, prompt_opts)
        self.pairs = []
        for i, rec in enumerate(records):
            item = make_item(i, rec, self.tokenizer, prompt_opts, template, "data.options")
            pair = {"prompt_ids": item.prompt_ids}
            pair.update(_response(i, rec, opts, len(self.tokenizer)))
            self.pairs.append(pair)
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
        out[SAMPLE_INDEX] = torch.arange(first, first + size, dtype=torch.int64)
        return {name: out[name] for name in self.fields}

    def close(self) -> None:
        pass


def _response(i: int, rec: Mapping[str, Any], opts: SFTOptions, vocab: int) -> dict[str, Any]:
    """Row i's response: {"response": text}, or {"response_ids", "response_mask"} for a
    response given as token ids (module docstring)."""
    response = field_at(rec, opts.response_key)
    if isinstance(response, str):
        return {"response": response}
    key = "data.options.response_key"
    if not _ids(response, vocab):
        raise ConfigError(
            key,
            f"row {i} has no string at {opts.response_key!r}, nor a list of token ids "
            f"(< {vocab}) (fields: {sorted(rec)})",
        )
    mask = field_at(rec, opts.response_mask_key)
    if mask is None:
        mask = [1] * len(response)
    if not _ids(mask, 2) or len(mask) != len(response) or mask[-1] != 1:
        raise ConfigError(
            "data.options.response_mask_key",
            f"row {i}: {opts.response_mask_key!r} must be 0/1 per response token "
            f"({len(response)}), ending on a 1 (a model token)",
        )
    return {"response_ids": list(response), "response_mask": list(mask)}


def _ids(value: Any, bound: int) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < bound for t in value)
    )


def field_at(record: Mapping[str, Any], key: str) -> Any:
    """`record[key]`, or for a dotted key ("extra_info.answer") the nested value; None
    when absent. A key that exists as written wins over its dotted reading."""
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value

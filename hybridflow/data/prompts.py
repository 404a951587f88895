"""Prompt datasets: records -> tokenized prompts (chat template when the tokenizer has one),
and a deterministic, resumable stream of prompt batches.

Consumes records from `sources.load_records` and a tokenizer; produces `PromptItem`s
(templated prompt text, its token ids, and per-sample metadata = every other field of
the record plus `index`, its row in the dataset), and `PromptStream`, which yields
lists of items epoch after epoch in a seeded order.

Tools (`tools:`, for multi-turn rollouts whose environment runs tools): each entry names
a "package.module:attr" whose tool schemas are passed to the chat template as `tools=`,
so the model sees what it may call. The attr is an environment class (built with no
arguments) or object with `tools_schema()`, e.g.
`hybridflow.stages.env.builtin.calculator:CalculatorEnv` (the same schemas its
observations are templated with), or a list of OpenAI function schemas. Without
`tools` (the default) the template is called exactly as before, without `tools=`.

Invariants:
  - a prompt longer than `max_prompt_length` tokens is an error naming its row, unless
    `truncation` says which side to cut (never a silent cut);
  - the stream order depends only on (seed, epoch); `state_dict()` is two ints, and a
    stream restored from it yields exactly what the original would have yielded next.
"""

from __future__ import annotations

import functools
import inspect
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridflow.config.imports import load_attr, split_spec
from hybridflow.data.sources import Record, load_records
from hybridflow.errors import ConfigError


@dataclass
class DataOptions:
    # .jsonl / .json / .parquet / datasets directory / task:NAME / memory:N (data/memory.py)
    source: str = ""
    prompt_key: str = "prompt"  # a string, or a list of {role, content} chat messages
    max_prompt_length: int = 256  # tokens
    # a prompt over max_prompt_length: an error naming its row, or cut on that side
    truncation: Literal["error", "left", "right"] = "error"
    chat_template: Literal["auto", "never"] = "auto"  # auto: use it when the tokenizer has one
    split: str | None = None  # for a datasets directory with several splits
    task_size: int = 1024  # prompts generated for task:NAME sources
    shuffle: bool = True  # a seeded new order every epoch; False: the source's order
    limit: int = 0  # only the first N records of the source (in its order); 0: all
    # "package.module:attr" entries whose tool schemas the chat template shows (see above)
    tools: list[str] = field(default_factory=list)

    def validate(self, path: str) -> None:
        if not self.source:
            raise ConfigError(f"{path}.source", "is required: a file, a directory or task:NAME")
        if self.max_prompt_length < 1:
            raise ConfigError(f"{path}.max_prompt_length", "must be >= 1")
        if self.limit < 0:
            raise ConfigError(f"{path}.limit", f"must be >= 0 (0: every record), got {self.limit}")
        for i, spec in enumerate(self.tools):
            split_spec(spec, f"{path}.tools[{i}]", form=_TOOLS_FORM)


_TOOLS_FORM = "package.module:attr"


def tool_schemas(specs: list[str] | tuple[str, ...], path: str = "data") -> list[dict[str, Any]]:
    """The tool schemas the `tools` entries name (module docstring), in order; ConfigError
    at `<path>.tools[i]` for an entry that names none. Resolved once per distinct list."""
    return json.loads(_tool_schemas(tuple(specs), path))  # a fresh copy for each caller


@functools.lru_cache(maxsize=8)
def _tool_schemas(specs: tuple[str, ...], path: str) -> str:
    schemas: list[dict[str, Any]] = []
    for i, spec in enumerate(specs):
        where = f"{path}.tools[{i}]"
        obj = load_attr(spec, where, form=_TOOLS_FORM)
        if callable(getattr(obj, "tools_schema", None)):
            try:
                owner = obj() if inspect.isclass(obj) else obj
                found = owner.tools_schema()
            except Exception as exc:  # its constructor or tools_schema: a config problem
                raise ConfigError(
                    where,
                    f"{spec}: asking it for tools_schema() raised {type(exc).__name__}: {exc}",
                ) from exc
        elif isinstance(obj, list | tuple):
            found = obj
        else:
            raise ConfigError(
                where,
                f"{spec} is a {type(obj).__name__}: name an environment class or object with "
                "tools_schema() (e.g. hybridflow.stages.env.builtin.calculator:CalculatorEnv) "
                "or a list of OpenAI function schemas",
            )
        for j, schema in enumerate(found):
            if not isinstance(schema, Mapping) or not isinstance(schema.get("function"), Mapping):
                raise ConfigError(
                    where,
                    f"{spec}: schema {j} is not an OpenAI function schema {{'function': ...}}",
                )
            schemas.append(dict(schema))
    names = [s["function"].get("name") for s in schemas]
    dup = sorted({str(n) for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{path}.tools", f"two tools share the name(s) {dup}")
    return json.dumps(schemas)


@dataclass
class PromptItem:
    text: str  # the prompt as the model sees it (chat template applied)
    prompt_ids: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)


class PromptDataset:
    """Tokenized prompts, built eagerly (prompt sets are small next to rollout cost)."""

    def __init__(
        self,
        records: list[Record],
        tokenizer: Any,
        opts: DataOptions,
        path: str = "data",
    ) -> None:
        if not records:
            raise ConfigError(f"{path}.source", f"{opts.source!r} holds no records")
        use_template = uses_template(tokenizer, opts)
        self.items = [
            make_item(i, rec, tokenizer, opts, use_template, path) for i, rec in enumerate(records)
        ]

    @classmethod
    def load(
        cls, opts: DataOptions, tokenizer: Any, *, seed: int = 0, path: str = "data"
    ) -> PromptDataset:
        records = load_records(
            opts.source, size=opts.task_size, seed=seed, split=opts.split, path=f"{path}.source"
        )
        return cls(records[: opts.limit] if opts.limit else records, tokenizer, opts, path)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]


def uses_template(tokenizer: Any, opts: DataOptions) -> bool:
    """Whether prompts go through the tokenizer's chat template."""
    return opts.chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None))


def make_item(
    index: int, rec: Record, tokenizer: Any, opts: DataOptions, use_template: bool, path: str
) -> PromptItem:
    """One record -> its PromptItem; `index` is stored as metadata["index"]."""
    where = f"{path}.source row {index}"
    if opts.prompt_key not in rec:
        raise ConfigError(
            f"{path}.prompt_key",
            f"row {index} has no {opts.prompt_key!r} field (fields: {sorted(rec)})",
        )
    prompt = rec[opts.prompt_key]
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(
        isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in prompt
    ):
        messages = prompt
    else:
        raise ConfigError(
            where, "the prompt must be a string or a list of {role, content} messages"
        )
    if use_template:
        # `tools=` only when some are named: the default call stays exactly what it was
        extra = {"tools": tool_schemas(opts.tools, path)} if opts.tools else {}
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra
        )
        # The template writes BOS itself; adding special tokens again would double it.
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    elif opts.tools:
        raise ConfigError(
            f"{path}.tools", "tools are shown through the chat template: this tokenizer has none"
        )
    elif isinstance(prompt, str):
        text = prompt
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    else:
        raise ConfigError(
            where, "chat messages need a tokenizer with a chat template (this one has none)"
        )
    if len(ids) > opts.max_prompt_length:
        if opts.truncation == "error":
            raise ConfigError(
                f"{path}.max_prompt_length",
                f"row {index} has {len(ids)} prompt tokens > {opts.max_prompt_length}; "
                "raise the limit or set truncation: left|right",
            )
        ids = (
            ids[-opts.max_prompt_length :]
            if opts.truncation == "left"
            else ids[: opts.max_prompt_length]
        )
    if not ids:
        raise ConfigError(where, "the prompt is empty after tokenization")
    meta = {k: v for k, v in rec.items() if k != opts.prompt_key}
    meta["index"] = index
    return PromptItem(text=text, prompt_ids=list(ids), metadata=meta)


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The dataset rows of `epoch` in visiting order: a permutation fixed by (seed, epoch)."""
    order = list(range(n))
    if shuffle:
        # A str seed is hashed with SHA-512 by `random`: the same order in every process.
        random.Random(f"hybridflow/prompts/{seed}/{epoch}").shuffle(order)
    return order


class PromptStream:
    """Endless batches of prompts: a seeded permutation per epoch, resumable."""

    def __init__(self, dataset: PromptDataset, seed: int = 0, shuffle: bool = True) -> None:
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        return epoch_order(len(self.dataset), self.seed, epoch, self.shuffle)

    def next_batch(self, n: int) -> list[PromptItem]:
        """The next `n` prompts, crossing into the next epoch (reshuffled) as needed."""
        out = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(n - len(out), len(self._order) - self.position)
            out += [self.dataset[i] for i in self._order[self.position : self.position + take]]
            self.position += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)

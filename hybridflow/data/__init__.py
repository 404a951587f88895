"""Prompt data: sources (jsonl / json / parquet / datasets dir / built-in task), tokenized
prompt datasets with a resumable stream, batch collation, and the built-in synthetic tasks."""

from hybridflow.data.batching import (
    collate_prompts,
    collate_sft,
    decode_metadata,
    encode_metadata,
    pad_left,
    pad_right,
    unpad,
)
from hybridflow.data.prompts import (
    DataOptions,
    PromptDataset,
    PromptItem,
    PromptStream,
    epoch_order,
)
from hybridflow.data.sources import load_records
from hybridflow.data.tasks import TASKS, Task, get_task

__all__ = [
    "TASKS",
    "DataOptions",
    "PromptDataset",
    "PromptItem",
    "PromptStream",
    "Task",
    "collate_prompts",
    "collate_sft",
    "decode_metadata",
    "encode_metadata",
    "epoch_order",
    "get_task",
    "load_records",
    "pad_left",
    "pad_right",
    "unpad",
]

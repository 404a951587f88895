"""Dataset arguments of the Python API -> the `source` option of the data sources.

    "last_digit"                  a built-in task name     -> "task:last_digit"
    "task:NAME", a path           passed through (the source checks it)
    ["prompt", ...] / [{...}]     written once to <log_dir>/prompts-<hash>.jsonl

Records are written as JSON (never pickled); the file name is the content's hash, so
the same list always maps to the same file and a resumed run reads the same data.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridflow.errors import ConfigError


def dataset_source(dataset: Any, log_dir: Path | None) -> str:
    """A dataset argument -> the data source's `source` option."""
    from hybridflow.data.tasks import TASKS

    if isinstance(dataset, Path):
        dataset = str(dataset)
    if isinstance(dataset, str):
        if dataset in TASKS:
            return f"task:{dataset}"
        return dataset  # task:NAME, a file or a directory: the source checks it
    if isinstance(dataset, Sequence) and dataset:
        records = [{"prompt": d} if isinstance(d, str) else dict(d) for d in dataset]
        base = log_dir or Path("runs")
        base.mkdir(parents=True, exist_ok=True)
        blob = json.dumps(records, sort_keys=True)
        path = base / f"prompts-{hashlib.sha256(blob.encode()).hexdigest()[:10]}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return str(path)
    raise ConfigError(
        "dataset", f"expected a task name, a path or a list of prompts, got {dataset!r}"
    )

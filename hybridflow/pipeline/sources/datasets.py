"""Dataset arguments of the Python API -> the `source` option of the data sources.

    "last_digit"                  a built-in task name     -> "task:last_digit"
    "task:NAME", a path           passed through (the source checks it)
    ["prompt", ...] / [{...}]     written once to <log_dir>/prompts-<hash>.jsonl
    a torch Dataset / IterableDataset, a Hugging Face Dataset / IterableDataset
                                  registered in-process   -> "memory:N" (data/memory.py)

Lists are written as JSON (never pickled); the file name is the content's hash, so the
same list always maps to the same file and a resumed run reads the same data. Dataset
objects are not written out: they may be large or endless, and the data source runs in
this process (the coordinator is on the Engine's thread), so it reads the object itself,
lazily, through the handle.

A Hugging Face stream's own position (`state_dict()`) is the one piece of data state the
step number does not give back; `save_stream_states` writes it beside each checkpoint
(`data-stream.json`) and `restore_stream_state` hands it back, so a resumed stream
starts there instead of re-reading every record before it (data/memory.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridflow.config.schema import Topology
from hybridflow.data import memory
from hybridflow.errors import ConfigError

log = logging.getLogger("hybridflow.sources")

STREAM_STATE = "data-stream.json"


def dataset_source(dataset: Any, log_dir: Path | None) -> str:
    """A dataset argument -> the data source's `source` option."""
    from hybridflow.data.tasks import TASKS

    if isinstance(dataset, Path):
        dataset = str(dataset)
    if isinstance(dataset, str):
        if dataset in TASKS:
            return f"task:{dataset}"
        return dataset  # task:NAME, a file or a directory: the source checks it
    if memory.kind_of(dataset) is not None:
        return memory.register(dataset)
    if isinstance(dataset, Sequence) and dataset:
        records = [{"prompt": d} if isinstance(d, str) else dict(d) for d in dataset]
        base = log_dir or Path("runs")
        base.mkdir(parents=True, exist_ok=True)
        blob = json.dumps(records, sort_keys=True)
        path = base / f"prompts-{hashlib.sha256(blob.encode()).hexdigest()[:10]}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return str(path)
    raise ConfigError(
        "dataset",
        "expected a task name, a path, a list of prompts, a torch Dataset / IterableDataset "
        f"or a Hugging Face Dataset / IterableDataset; got {type(dataset).__name__}",
    )


def _stream(topo: Topology) -> tuple[memory.StreamRecords, int] | None:
    """The HF stream a `prompts` topology reads, and its prompts per step; else None."""
    source = topo.data.options.get("source", "")
    if topo.data.source != "prompts" or not isinstance(source, str):
        return None
    if not memory.is_handle(source):
        return None
    records = memory.lookup(source, "data.options.source")
    if not isinstance(records, memory.StreamRecords) or not records.exact_state:
        return None
    n = topo.data.options.get("samples_per_prompt", 1)
    return records, topo.run.step_batch // n


def save_stream_states(topo: Topology, checkpoints: Sequence[str]) -> None:
    """Beside each checkpoint of a job of `topo`: its HF stream's state at that step."""
    found = _stream(topo)
    if found is None:
        return
    records, per_step = found
    for ck in checkpoints:
        root = Path(ck)
        if not (root / "meta.json").is_file():
            continue  # pruned by keep_last since
        step = int(json.loads((root / "meta.json").read_text())["step"])
        snap = records.state_at(step * per_step)
        if snap is None:
            continue  # not snapshotted: a resume reads the stream up to it instead
        tmp = root / f".tmp-{STREAM_STATE}"
        tmp.write_text(json.dumps({"record": step * per_step, **snap}))
        os.replace(tmp, root / STREAM_STATE)


def restore_stream_state(topo: Topology, checkpoint: str | None) -> None:
    """Give a job's HF stream the state its checkpoint holds (if it holds one)."""
    found = _stream(topo)
    if found is None or checkpoint is None:
        return
    path = Path(checkpoint) / STREAM_STATE
    if not path.is_file():
        log.info("%s has no %s: the stream is read up to its position", checkpoint, STREAM_STATE)
        return
    saved = json.loads(path.read_text())
    found[0].restore(int(saved["record"]), {"epoch": saved["epoch"], "state": saved["state"]})

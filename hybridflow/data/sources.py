"""Read prompt records (plain dicts) from a file, a dataset directory or a built-in task.

Sources:
  path.jsonl           one JSON object per line (blank lines skipped)
  path.json            a JSON array of objects
  path.parquet         needs `pyarrow`
  directory            a Hugging Face `datasets` directory (`save_to_disk` output); read
                       with `datasets` when installed (and the directory has its
                       dataset_info.json), else directly with `pyarrow` (the on-disk
                       format is Arrow IPC streams listed in state.json)
  task:NAME            a built-in synthetic task (tasks.py), `size` prompts from `seed`

Invariants: records are plain JSON-like dicts; nothing is unpickled or eval'd; every
error names the source and, for a bad line, its line number.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridflow.errors import ConfigError

Record = dict[str, Any]


def load_records(
    source: str,
    *,
    size: int = 1024,
    seed: int = 0,
    split: str | None = None,
    path: str = "data.source",
) -> list[Record]:
    """All records of `source` (see the module docstring). `size`/`seed`: task sources."""
    if source.startswith("memory:"):
        raise ConfigError(
            path,
            "an in-memory dataset (torch / Hugging Face object) feeds the prompts source of "
            "Engine.train; here give a task name, a file or a list of records",
        )
    if source.startswith("task:"):
        from hybridflow.data.tasks import TASKS

        name = source.removeprefix("task:")
        if name not in TASKS:
            raise ConfigError(path, f"unknown built-in task {name!r}; known: {', '.join(TASKS)}")
        return TASKS[name].prompts(size, seed)
    p = Path(source).expanduser()
    if p.is_dir():
        return _read_hf_dir(p, split, path)
    if not p.is_file():
        raise ConfigError(path, f"no dataset at {source!r} (a file, a directory or task:NAME)")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(p, path)
    if suffix == ".json":
        return _read_json(p, path)
    if suffix == ".parquet":
        return _read_parquet(p, path)
    raise ConfigError(path, f"{source!r}: unknown format {suffix!r}; use .jsonl, .json, .parquet")


def _read_jsonl(p: Path, path: str) -> list[Record]:
    out = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(path, f"{p}:{lineno}: not valid JSON: {exc}") from exc
            if not isinstance(rec, dict):
                raise ConfigError(path, f"{p}:{lineno}: expected a JSON object per line")
            out.append(rec)
    return out


def _read_json(p: Path, path: str) -> list[Record]:
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(path, f"{p}: not valid JSON: {exc}") from exc
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ConfigError(path, f"{p}: expected a JSON array of objects")
    return data


def _pyarrow(path: str, what: str) -> Any:
    try:
        import pyarrow
    except ImportError:
        raise ConfigError(
            path, f"reading {what} needs pyarrow: `pip install pyarrow` (or use .jsonl)"
        ) from None
    import pyarrow

    return pyarrow


def _read_parquet(p: Path, path: str) -> list[Record]:
    _pyarrow(path, "Parquet files")
    import pyarrow.parquet as pq

    try:
        return pq.read_table(p).to_pylist()
    except Exception as exc:  # pyarrow raises several unrelated types for bad files
        raise ConfigError(path, f"{p}: cannot read as Parquet: {exc}") from exc


def _read_hf_dir(p: Path, split: str | None, path: str) -> list[Record]:
    """A `datasets.save_to_disk` directory: a Dataset, or a DatasetDict of splits."""
    if (p / "dataset_dict.json").is_file():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        chosen = split or ("train" if "train" in splits else None)
        if chosen is None or chosen not in splits:
            raise ConfigError(
                f"{path}", f"{p} holds splits {splits}; choose one with `split:` (got {split!r})"
            )
        p = p / chosen
    if not (p / "state.json").is_file():
        raise ConfigError(
            path,
            f"{p} is not a Hugging Face datasets directory (no state.json / dataset_dict.json)",
        )
    if not (p / "dataset_info.json").is_file():  # not written by `datasets` itself
        return _read_arrow_dir(p, path)
    try:
        import datasets
    except ImportError:
        return _read_arrow_dir(p, path)
    return list(datasets.load_from_disk(str(p)))


def _read_arrow_dir(p: Path, path: str) -> list[Record]:
    pa = _pyarrow(path, "a Hugging Face datasets directory without `datasets` installed")
    state = json.loads((p / "state.json").read_text())
    files = [f["filename"] for f in state.get("_data_files", [])]
    if not files:
        raise ConfigError(path, f"{p}/state.json lists no data files")
    out: list[Record] = []
    for name in files:
        fp = p / name
        if fp.resolve().parent != p.resolve():
            raise ConfigError(path, f"{p}/state.json names a file outside the directory: {name!r}")
        with pa.memory_map(str(fp)) as source:
            out.extend(pa.ipc.open_stream(source).read_all().to_pylist())
    return out

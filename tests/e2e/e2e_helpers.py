"""Helpers for the end-to-end RL tests: bundled presets, shrunk by `--set`-style overrides,
writing into a temporary run directory. Every run here is real: stage processes, ZeroMQ,
tiny random-init models, the built-in tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridflow.config.schema import Topology, load_topology


def preset(name: str, run_dir: Path, *overrides: str) -> Topology:
    return load_topology(name, [f"run_dir={run_dir}", *overrides])


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)

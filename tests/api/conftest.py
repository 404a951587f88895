"""Fixtures shared by the engine tests (test_api_engine*.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_job import builder


@pytest.fixture(scope="session")
def engine_reference(tmp_path_factory):
    """The engine job's 6 uninterrupted steps, run once for every engine test that
    compares against them: (metrics rows, the final checkpoint, the log dir)."""
    log_dir = tmp_path_factory.mktemp("ref")
    with builder().build(metrics_backend="jsonl", log_dir=log_dir) as engine:
        result = engine.train("last_digit", steps=6)
    return result.metrics, Path(result.checkpoint), log_dir

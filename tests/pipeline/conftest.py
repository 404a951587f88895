"""Fixtures of the pipeline tests; plain helpers live in pipeline_helpers.py."""

from __future__ import annotations

from typing import Any

import pytest
from pipeline_helpers import small_topology


@pytest.fixture
def topo_dict(tmp_path: Any):
    def make(**run: Any) -> dict[str, Any]:
        return small_topology(tmp_path, **run)

    return make

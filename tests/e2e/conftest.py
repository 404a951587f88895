"""Every end-to-end run here uses one intra-op thread per process (see the fixture)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def one_thread_per_process(monkeypatch):
    """Stage processes inherit one intra-op thread (as under `hybridflow demo`): no
    OpenMP oversubscription on a loaded 2-core machine, and the same float reductions
    (so the same seeded trajectory) on any machine."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

"""Shared test fixtures. GPU tests are marked `gpu` and skip cleanly without CUDA."""

from __future__ import annotations

import os

import pytest


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # torch missing or broken CUDA: treat as no GPU
        return 0


def pytest_collection_modifyitems(config, items):
    n = _cuda_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and n < 1:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(skip_multi)


@pytest.fixture
def shm_clean():
    """Fail a test that leaves hybridflow shared-memory segments behind."""
    before = {f for f in os.listdir("/dev/shm") if f.startswith("hybridflow-")}
    yield
    after = {f for f in os.listdir("/dev/shm") if f.startswith("hybridflow-")}
    leaked = after - before
    for name in leaked:
        os.unlink(os.path.join("/dev/shm", name))
    assert not leaked, f"leaked shared memory: {sorted(leaked)}"

"""Fixtures for transport tests: short ipc:// endpoints, spawned peer processes, a run id."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator

import pytest


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    # ipc:// paths must stay under ~100 bytes: pytest's tmp_path can be longer.
    d = tempfile.mkdtemp(prefix="hft-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def endpoint(ipc_dir: str) -> str:
    return f"ipc://{ipc_dir}/ch.sock"


@pytest.fixture
def run_id() -> str:
    # Unique per test so that shm sweeps and leak checks never see another test's segments.
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def spawn() -> Iterator[Callable[..., mp.Process]]:
    """Start a real (spawned) process; killed at teardown if still alive."""
    procs: list[mp.Process] = []

    def start(target: Callable[..., None], *args: object) -> mp.Process:
        p = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
        p.start()
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)

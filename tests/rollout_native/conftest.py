"""Fixtures of the native engine tests (helpers live in native_helpers.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from native_helpers import build

from hybridflow.models.loader import load_tokenizer


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """Tiny models on a shared 2-core machine: a second OpenMP thread only spins waiting
    for a busy core (100x slower here), so these tests run single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return load_tokenizer("builtin")


@pytest.fixture(scope="session", params=["tiny", "tiny-llama", "tiny-qwen3", "tiny-mistral"])
def model(request: pytest.FixtureRequest, tokenizer: Any) -> Any:
    return build(tokenizer, request.param)


@pytest.fixture(scope="session")
def qwen(tokenizer: Any) -> Any:
    return build(tokenizer, "tiny")

"""Fixtures for the vLLM rollout backend tests: one tiny model, one engine per session.

These tests run under `.venv-vllm/bin/python` (made by scripts/install_vllm_cpu.sh); in an
environment without vLLM every test that needs the engine is skipped at setup.

The model is a random tiny Qwen2 (hidden 128, head_dim 64: vLLM's CPU attention kernel
rejects head_dim 16) with tied embeddings, saved as safetensors in a temp dir. Starting the
engine takes ~10-30 s on a 2-core machine, so it is session-scoped and shared; every test
that needs specific weights loads them itself through the backend's reshard path.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from _tiny_qwen2 import tiny_qwen2

from hybridflow.stages import vllm_compat


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_qwen2(seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def rollout(model_dir, tmp_path_factory):
    """The backend under test: VLLMRollout set up on the tiny model (skips without vLLM)."""
    if not vllm_compat.vllm_available():
        pytest.skip("vLLM not installed (run scripts/install_vllm_cpu.sh, use .venv-vllm)")
    from hybridflow.stages.base import StageContext
    from hybridflow.stages.rollout_vllm import VLLMRollout

    role = VLLMRollout()
    ctx = StageContext(
        stage="rollout",
        replica=0,
        device=torch.device("cpu"),
        seed=1234,
        run_dir=tmp_path_factory.mktemp("run"),
        options={
            "model": str(model_dir),
            "dtype": "float32",
            "max_new_tokens": 12,
            "max_model_len": 128,
            "kv_cache_bytes": 32 << 20,
        },
        log=logging.getLogger("test.vllm"),
    )
    role.setup(ctx)
    yield role
    role.close()

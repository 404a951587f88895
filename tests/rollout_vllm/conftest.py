"""Fixtures for the vLLM rollout backend tests: one engine per session.

These tests run under `.venv-vllm/bin/python` (made by scripts/install_vllm_cpu.sh); in an
environment without vLLM every test that needs the engine is skipped at setup.

Starting the engine takes ~5-30 s on a 2-core machine, so it is session-scoped and
shared; every test that needs specific weights loads them itself through the backend's
reshard path. The initial greedy output is captured right after start-up, before any
test changes the weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _policy import PRESET, RUN_SEED, left_pad

from hybridflow.stages import vllm_compat
from hybridflow.stages.base import StageContext

MAX_NEW = 12
OPTIONS = {
    "model": PRESET,
    "max_new_tokens": MAX_NEW,
    "max_model_len": 128,
    "kv_cache_bytes": 32 << 20,
}
# Fixed prompts decoded greedily right after start-up (from the preset's init weights).
INITIAL_PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46]]


def make_ctx(run_dir: Path, **options) -> StageContext:
    return StageContext(
        stage="rollout",
        replica=0,
        device=torch.device("cpu"),
        seed=RUN_SEED,
        run_dir=run_dir,
        options={**OPTIONS, **options},
        log=logging.getLogger("test.vllm"),
    )


@dataclass
class Engine:
    role: object  # VLLMRollout
    initial: dict[str, torch.Tensor]  # greedy generate() on INITIAL_PROMPTS before any reshard


@pytest.fixture(scope="session")
def engine(tmp_path_factory) -> Engine:
    if not vllm_compat.vllm_available():
        pytest.skip("vLLM not installed (run scripts/install_vllm_cpu.sh, use .venv-vllm)")
    from hybridflow.stages.rollout_vllm import VLLMRollout

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

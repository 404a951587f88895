"""Plain helpers of the vLLM tests (imported by name; conftest.py holds the fixtures)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from _policy import PRESET, RUN_SEED

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

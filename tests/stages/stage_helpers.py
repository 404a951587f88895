"""Helpers for the role-contract tests: contexts, roles set up on tiny models, batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridflow.data.batching import pad_left
from hybridflow.models import builtin_tokenizer
from hybridflow.stages.base import StageContext

TOK = builtin_tokenizer()
PROMPTS = ["last:40719=", "copy:47=", "parity:10110="]


def make_role(cls: type, stage: str, options: dict[str, Any], **ctx_kw: Any) -> Any:
    ctx = StageContext(
        stage=stage,
        replica=ctx_kw.pop("replica", 0),
        device=ctx_kw.pop("device", torch.device("cpu")),
        seed=ctx_kw.pop("seed", 0),
        run_dir=Path("/nonexistent"),
        options=options,
        **ctx_kw,
    )
    role = cls()
    role.setup(ctx)
    return role


def prompt_batch(texts: list[str] = PROMPTS) -> dict[str, torch.Tensor]:
    ids, mask = pad_left([TOK(t)["input_ids"] for t in texts], TOK.pad_token_id)
    return {"prompt_ids": ids, "prompt_mask": mask}


def sequences(rollout_out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    return {k: rollout_out[k] for k in keys}

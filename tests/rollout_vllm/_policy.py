"""The policy the vLLM tests run: the `tiny-vllm` preset (Qwen2, hidden 128, head_dim 64;
vLLM's CPU attention kernel rejects head_dim 16) with the built-in tokenizer, built exactly
as the roles build it."""

from __future__ import annotations

import torch

from hybridflow.models.loader import ModelOptions, load_model
from hybridflow.models.tokenizer import builtin_tokenizer

PRESET = "tiny-vllm"
RUN_SEED = 1234  # the stage seed in conftest: the engine starts from policy(RUN_SEED)
_TOK = builtin_tokenizer()
VOCAB = len(_TOK)
EOS = int(_TOK.eos_token_id)
PAD = int(_TOK.pad_token_id)


def policy(seed: int = RUN_SEED) -> torch.nn.Module:
    """The preset's HF model with the init seed `seed` (fp32, eval mode)."""
    return load_model(ModelOptions(model=PRESET), builtin_tokenizer(), seed=seed)


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def responses(out: dict[str, torch.Tensor]) -> list[list[int]]:
    ids, mask = out["response_ids"], out["response_mask"]
    return [ids[r][mask[r].bool()].tolist() for r in range(ids.shape[0])]

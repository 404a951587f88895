"""The `model` reward backend: a Hugging Face sequence-classification reward model.

  score   prompt_ids/prompt_mask [B, P], response_ids/response_mask [B, R]
      ->  rewards [B] float32: the model's single logit read at each sequence's last real
          token (the last response token; the prompt's if the response is empty)

The score is read at the last position where the attention mask is 1, computed here
rather than by transformers' pooling, which looks for the last token that is not the pad
id and so misreads any sequence that ends in an EOS sharing the pad id.

Options: the model options of hybridflow.models (`model`: a directory written by
`save_pretrained` of an `...ForSequenceClassification` model with one label, or a preset,
randomly initialised: for tests and benchmarks), plus forward_batch_size.
Stateless for checkpoints (the reward model is never trained here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.config.loader import from_dict
from hybridflow.errors import ConfigError
from hybridflow.models.loader import ModelOptions
from hybridflow.stages.base import Batch, Metrics, Params, StageContext
from hybridflow.stages.common import (
    SEQUENCE_FIELDS,
    build_model,
    check_sequences,
    chunked_no_grad,
    options_path,
    sequence_inputs,
)
from hybridflow.stages.contract import RoleBase, op


@dataclass
class ModelRewardOptions(ModelOptions):
    forward_batch_size: int = 0  # rows per forward (0: the whole micro-batch)


class ModelReward(RoleBase):
    """Registered as ("reward", "model")."""

    options_cls = ModelRewardOptions  # checked at plan time too (pipeline/plan/planner.py)

    def __init__(self) -> None:
        self.opts: ModelRewardOptions | None = None
        self.model: Any = None

    def setup(self, ctx: StageContext) -> None:
        self.opts = from_dict(ModelRewardOptions, dict(ctx.options), options_path(ctx))
        self.device = ctx.device
        self.tokenizer, self.model = build_model(ctx, self.opts, "reward")
        self.model.requires_grad_(False)
        if not hasattr(self.model, "score") or self.model.config.num_labels != 1:
            raise ConfigError(
                f"{options_path(ctx)}.model",
                f"{type(self.model).__name__} is not a one-label sequence-classification "
                "model with a `score` head",
            )

    @op(inputs=SEQUENCE_FIELDS, outputs=("rewards",))
    def score(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """One score per row from the reward model's head at the last real token."""
        assert self.opts is not None
        check_sequences(batch, "reward model score", self.model.config.vocab_size)
        rewards = chunked_no_grad(self._score, batch, self.opts.forward_batch_size)
        return {"rewards": rewards}, {}

    def _score(self, batch: Batch) -> torch.Tensor:
        """-> [b] scores at the last attended position of each row."""
        ids, mask, pos = sequence_inputs(batch, self.device)
        hidden = self.model.base_model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False
        ).last_hidden_state  # [b, T, H]
        t_idx = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        last = torch.where(mask.bool(), t_idx, -1).amax(dim=-1)  # [b]
        picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # [b, H]
        return self.model.score(picked)[:, 0].float()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        self.model = None

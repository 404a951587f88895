"""The reference role (backend `hf`): a frozen copy of the initial policy.

  get_logprob   prompt_ids/prompt_mask [B, P], response_ids/response_mask [B, R]
            ->  ref_logprobs [B, R] float32   log pi_ref(token), logits / `temperature`
                                              (0 at padding)

Built from the same `model` options (and the same run seed) as the actor, it holds the
actor's initial weights bit for bit; nothing ever trains it, so it has no state to
checkpoint (it is rebuilt identically on resume).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    response_logprobs,
)
from hybridflow.stages.contract import RoleBase, op
from hybridflow.stages.parallel.options import ShardingOptions
from hybridflow.stages.parallel.role import ShardedModelRole


@dataclass
class ReferenceOptions(ModelOptions, ShardingOptions):
    temperature: float = 1.0  # must match the actor's
    forward_batch_size: int = 0  # rows per forward (0: the whole micro-batch)

    def validate(self, path: str) -> None:
        ModelOptions.validate(self, path)
        self.validate_sharding(path)
        if self.temperature <= 0:
            raise ConfigError(f"{path}.temperature", f"must be > 0, got {self.temperature}")


class Reference(ShardedModelRole, RoleBase):
    """Registered as ("reference", "hf")."""

    options_cls = ReferenceOptions  # checked at plan time too (pipeline/compiler/plan.py)

    def __init__(self) -> None:
        self.opts: ReferenceOptions | None = None
        self.model: Any = None

    def setup(self, ctx: StageContext) -> None:
        self.opts = from_dict(ReferenceOptions, dict(ctx.options), options_path(ctx))
        self.device = ctx.device
        self.tokenizer, self.model = build_model(ctx, self.opts, "causal_lm")
        self.model.requires_grad_(False)
        # Sharded only with `fsdp: true` (frozen: its replicas may as well be full copies).
        self.shard_if_asked(ctx, self.opts, trainable=False)

    @op(inputs=SEQUENCE_FIELDS, outputs=("ref_logprobs",))
    def get_logprob(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """Log-probs of the responses under the frozen reference policy."""
        assert self.opts is not None
        check_sequences(batch, "reference.get_logprob", self.model.config.vocab_size)
        opts = self.opts
        ref = chunked_no_grad(
            lambda b: response_logprobs(self.model, b, self.device, opts.temperature)[0],
            batch,
            opts.forward_batch_size,
        )
        return {"ref_logprobs": ref}, {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        self.model = None

"""The reference role (backend `hf`): a frozen copy of the initial policy.

  get_logprob   prompt_ids/prompt_mask [B, P], response_ids/response_mask [B, R]
            ->  ref_logprobs [B, R] float32   log pi_ref(token), logits / `temperature`
                                              (0 at padding)

Built from the same `model` options (and the same run seed) as the actor, it holds the
actor's initial weights bit for bit; nothing ever trains it, so it has no state to
checkpoint (it is rebuilt identically on resume). Its forwards take the packing options
of stages/packing.py (token-budget row groups, packed sequences) as the actor's do.

The reference from the same weights (`share_base`): colocated with a LoRA actor whose
model options are its own, the reference holds no model of its own; it runs the actor's
model with the adapters disabled (the base weights are frozen there, so they ARE the
initial policy). `share_base: null` (default) does so when a colocated role offers its
base (`base_model_for`, stages/parallel/role.py) and loads its own model otherwise;
`true` requires sharing (ConfigError naming why it cannot); `false` always loads. The
decision waits until every colocated role is set up (`bind_colocated`, called by the
stage host after setup, else at the first task): roles set up in config order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.config.loader import from_dict
from hybridflow.errors import ConfigError
from hybridflow.models.head_logprobs import LogprobOptions
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
from hybridflow.stages.packing import (
    PackingOptions,
    check_packing,
    compile_layers,
    forward_groups,
)
from hybridflow.stages.parallel.options import ShardingOptions
from hybridflow.stages.parallel.role import ShardedModelRole


@dataclass
class ReferenceOptions(ModelOptions, ShardingOptions, LogprobOptions, PackingOptions):
    temperature: float = 1.0  # must match the actor's
    forward_batch_size: int = 0  # rows per forward (0: the whole micro-batch)
    # The colocated LoRA actor's base weights instead of a copy (module docstring):
    # null: when possible; true: required; false: never.
    share_base: bool | None = None

    def validate(self, path: str) -> None:
        ModelOptions.validate(self, path)
        self.validate_sharding(path)
        self.validate_logprob(path)
        self.validate_packing(path)
        if self.temperature <= 0:
            raise ConfigError(f"{path}.temperature", f"must be > 0, got {self.temperature}")


class Reference(ShardedModelRole, RoleBase):
    """Registered as ("reference", "hf")."""

    options_cls = ReferenceOptions  # checked at plan time too (pipeline/plan/planner.py)

    def __init__(self) -> None:
        self.opts: ReferenceOptions | None = None
        self.model: Any = None
        # Set when sharing a colocated role's model: the context that disables its adapters.
        self.base_context: Callable[[], AbstractContextManager[None]] | None = None
        self._ctx: StageContext | None = None  # until bound (share_base decided)

    def setup(self, ctx: StageContext) -> None:
        self.opts = from_dict(ReferenceOptions, dict(ctx.options), options_path(ctx))
        self.device = ctx.device
        if self.opts.share_base is False or not self._sharers(ctx):
            if self.opts.share_base:
                raise ConfigError(
                    f"{options_path(ctx)}.share_base",
                    "true needs a colocated LoRA actor in this stage; there is none "
                    f"(colocated: {sorted(ctx.colocated)})",
                )
            self._build(ctx)
        else:
            self._ctx = ctx  # decided in bind_colocated

    def _sharers(self, ctx: StageContext) -> dict[str, Any]:
        return {
            name: role
            for name, role in ctx.colocated.items()
            if role is not self and callable(getattr(role, "base_model_for", None))
        }

    def _build(self, ctx: StageContext) -> None:
        assert self.opts is not None
        self.tokenizer, self.model = build_model(ctx, self.opts, "causal_lm")
        self.model.requires_grad_(False)
        # Sharded only with `fsdp: true` (frozen: its replicas may as well be full copies).
        self.shard_if_asked(ctx, self.opts, trainable=False)
        check_packing(self.opts, self.model, self.group is not None, options_path(ctx))
        compile_layers(
            self.opts.compile_layers,
            self.model,
            self.group is not None,
            options_path(ctx),
            self._logprobs,
            (False,),
            self.opts.max_tokens_per_micro_batch,
        )

    def _logprobs(self, group: Batch) -> torch.Tensor:
        """Log-probs [b, R] of one forward's rows (padded or packed per the options)."""
        o = self.opts
        assert o is not None
        return response_logprobs(
            self.model,
            group,
            self.device,
            o.temperature,
            chunk_tokens=o.logprob_chunk_tokens,
            packed=o.pack_sequences,
            kernel=o.logprob_kernel,
        )[0]

    def bind_colocated(self) -> None:
        """Share a colocated role's base model, or load one's own (module docstring).
        Once, after every role of the process is set up; a no-op afterwards."""
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        assert self.opts is not None
        why = []
        for name, role in self._sharers(ctx).items():
            got = role.base_model_for(self.opts, kind="causal_lm", sharded=self.opts.fsdp is True)
            if isinstance(got, str):
                why.append(f"{name}: {got}")
                continue
            self.model, self.base_context = got
            check_packing(self.opts, self.model, self.group is not None, options_path(ctx))
            ctx.log.info("reference: %s's base weights, adapters disabled (no copy)", name)
            return
        if self.opts.share_base:
            raise ConfigError(
                f"{options_path(ctx)}.share_base",
                "true, but no colocated role can lend its base weights: " + "; ".join(why),
            )
        self._build(ctx)

    @op(inputs=SEQUENCE_FIELDS, outputs=("ref_logprobs",))
    def get_logprob(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """Log-probs of the responses under the frozen reference policy."""
        assert self.opts is not None
        self.bind_colocated()
        check_sequences(batch, "reference.get_logprob", self.model.config.vocab_size)
        opts = self.opts
        with self.base_context() if self.base_context else contextlib.nullcontext():
            ref = chunked_no_grad(
                self._logprobs,
                batch,
                opts.forward_batch_size,
                groups=forward_groups(batch, opts, opts.forward_batch_size),
            )
        return {"ref_logprobs": ref}, {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        self.model = self.base_context = None

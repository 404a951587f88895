"""The critic role (backend `hf`): a value head on a causal-LM trunk, and its update.

The model is transformers' token-classification model with one label: the causal LM's
trunk plus a linear head, giving one value per position. A preset builds it with random
init; a causal-LM directory loads the trunk and initialises the head (seeded).

  values          prompt_ids/prompt_mask [B, P], response_ids/response_mask [B, R]
              ->  values [B, R] float32   V(state before response token t), 0 at padding
  update          + returns [B, R]        required (e.g. from GAE)
                  + values  [B, R]        optional: the values at rollout time, the centre
                                          of the value clip; when absent, computed now
              ->  {}  metrics: this micro-batch's critic/vf_loss, ... (streamed mode)
  optimizer_step  (no batch) -> {}  metrics critic/vf_loss, critic/vf_clipfrac,
                  critic/vpred_mean, critic/grad_norm, critic/lr, critic/updates,
                  critic/skipped_updates (authoritative, per step)

Loss: 0.5 * max((V - R)^2, (clip(V, V_old +- cliprange_value) - R)^2), aggregated by
`loss_agg_mode` (hybridflow.algos.value_loss). Micro-batches, ppo_epochs, mini_batches
and gradient accumulation behave exactly as for the actor (trainer.py), and so do the
packing options (stages/packing.py: token-budget forwards, packed sequences). LoRA options
(`lora_rank`, ...: models/lora.py) train adapters on the trunk and the whole value head.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.algos.losses import value_loss
from hybridflow.config.loader import from_dict
from hybridflow.errors import BatchError, ConfigError
from hybridflow.models.loader import ModelOptions
from hybridflow.models.lora import LoraOptions
from hybridflow.stages.base import Batch, Metrics, Params, StageContext
from hybridflow.stages.common import (
    SEQUENCE_FIELDS,
    build_model,
    check_sequences,
    chunked_no_grad,
    options_path,
    response_values,
    training_attention,
)
from hybridflow.stages.contract import RoleBase, Scope, op
from hybridflow.stages.packing import (
    PackingOptions,
    Rows,
    check_packing,
    compile_layers,
    forward_groups,
)
from hybridflow.stages.parallel.options import ShardingOptions
from hybridflow.stages.parallel.role import ShardedModelRole
from hybridflow.stages.trainer import Trainer, TrainOptions, denominator


@dataclass
class CriticOptions(ModelOptions, TrainOptions, ShardingOptions, LoraOptions, PackingOptions):
    cliprange_value: float | None = 0.5  # None: plain 0.5 * MSE

    def validate(self, path: str) -> None:
        ModelOptions.validate(self, path)
        TrainOptions.validate(self, path)
        self.validate_sharding(path)
        self.validate_lora(path)
        self.validate_packing(path)
        if self.cliprange_value is not None and self.cliprange_value < 0:
            raise ConfigError(f"{path}.cliprange_value", "must be >= 0 or null")


class Critic(ShardedModelRole, RoleBase):
    """Registered as ("critic", "hf")."""

    options_cls = CriticOptions  # checked at plan time too (pipeline/plan/planner.py)
    trainable = True

    def __init__(self) -> None:
        self.opts: CriticOptions | None = None
        self.model: Any = None
        self.trainer: Trainer | None = None

    def setup(self, ctx: StageContext) -> None:
        self.opts = from_dict(CriticOptions, dict(ctx.options), options_path(ctx))
        self.device = ctx.device
        self.tokenizer, self.model = build_model(ctx, self.opts, "value")
        training_attention(ctx.device)  # before any forward: see its docstring
        self.add_adapters(ctx, self.opts, "value")  # LoRA: the value head still trains whole
        self.shard_if_asked(ctx, self.opts, trainable=True)
        check_packing(self.opts, self.model, self.group is not None, options_path(ctx))
        packed = self.opts.pack_sequences
        compile_layers(
            self.opts.compile_layers,
            self.model,
            self.group is not None,
            options_path(ctx),
            lambda b: response_values(self.model, b, self.device, packed=packed),
            (True, False),  # update (grad) and the values op (no grad)
            self.opts.max_tokens_per_micro_batch,
        )
        self.trainer = Trainer(
            self.model,
            self.opts,
            seed=ctx.seed,
            prefix="critic",
            log=ctx.log,
            group=self.group,
            split=self._groups,
        )

    def close(self) -> None:
        self.model = self.trainer = None

    def state_dict(self) -> dict[str, Any]:
        """Weights and optimizer moments are written by `save_shards` (DCP)."""
        assert self.trainer is not None
        return {"trainer": self.trainer.state_dict(optimizer=False)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.trainer is not None
        self.trainer.load_state_dict(state["trainer"])

    @op(name="values", inputs=SEQUENCE_FIELDS, outputs=("values",))
    def _op_values(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """V(state before each response token) [B, R]."""
        check_sequences(batch, "critic.values", self.model.config.vocab_size)
        return {"values": self._values_no_grad(batch)}, {}

    @op(name="update", inputs=SEQUENCE_FIELDS)
    def _op_update(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """Accumulate the value-loss gradient of one micro-batch."""
        return {}, self.update(batch)

    @op(name="optimizer_step", scope=Scope.STEP)
    def _op_optimizer_step(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """Apply the accumulated gradients."""
        assert self.trainer is not None
        return {}, self.trainer.step()

    def _groups(self, batch: Batch) -> Iterator[Rows]:
        """The row groups of one forward each (forward_batch_size rows or a token budget)."""
        assert self.opts is not None
        return forward_groups(batch, self.opts, self.opts.forward_batch_size)

    def _values_no_grad(self, batch: Batch) -> torch.Tensor:
        o = self.opts
        assert o is not None
        return chunked_no_grad(
            lambda b: response_values(self.model, b, self.device, packed=o.pack_sequences),
            batch,
            o.forward_batch_size,
            groups=self._groups(batch),
        )

    def update(self, batch: Batch) -> Metrics:
        assert self.trainer is not None
        where = "critic.update"
        check_sequences(batch, where, self.model.config.vocab_size)
        mask = batch["response_mask"]
        mb = {k: batch[k] for k in SEQUENCE_FIELDS}
        for name in ("returns", "values"):
            if name not in batch:
                continue
            t = batch[name]
            if t.shape != mask.shape or not t.dtype.is_floating_point:
                raise BatchError(
                    f"{where}: {name} must be float [B, R] = {tuple(mask.shape)}, got "
                    f"{t.dtype} {tuple(t.shape)}"
                )
            if not bool(torch.isfinite(t[mask.bool()]).all()):
                raise BatchError(f"{where}: {name} holds NaN/inf at response tokens")
            mb[name] = t
        if "returns" not in mb:
            raise BatchError(f"{where}: batch lacks 'returns'; it has {sorted(batch)}")
        if "values" not in mb:
            mb["values"] = self._values_no_grad(mb)  # the critic before this step's updates
        return self.trainer.add(mb, self._loss)

    def _loss(self, mb: Batch) -> tuple[torch.Tensor, int, dict[str, float]]:
        o = self.opts
        assert o is not None
        dev = self.device
        mask = mb["response_mask"].to(dev)
        values = response_values(self.model, mb, dev, packed=o.pack_sequences)
        count = denominator(mask, o.loss_agg_mode)
        loss, st = value_loss(
            values,
            mb["values"].to(dev, torch.float32),
            mb["returns"].to(dev, torch.float32),
            mask,
            o.cliprange_value,
            o.loss_agg_mode,
            denom=1.0,
        )
        stats = {
            "vf_loss": float(st["vf_loss"]) / max(count, 1),
            "vf_clipfrac": float(st["vf_clipfrac"]),
            "vpred_mean": float(st["vpred_mean"]),
        }
        return loss, count, stats

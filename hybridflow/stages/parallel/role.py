"""What a model-backed role adds to run as FSDP ranks (actor, critic, reference).

`ShardedModelRole` is a mixin: the role builds its model as usual, then calls
`shard_if_asked`, which joins the group and wraps the model when the options and the
number of replicas say so (options.py). Everything that reads or writes whole weights
goes through here, so it works sharded or not:

  named_full_weights()      (HF name, full tensor) one parameter at a time (collective)
  save_shards / load_shards weights + AdamW moments via DCP (checkpoint.py); also for an
                            unsharded model, so one checkpoint format serves every rank
                            count
  export_pretrained         the full model as one HF `save_pretrained` directory, written
                            by rank 0 after a collective gather
  add_adapters              LoRA (models/lora.py), before sharding; then the weights sent
                            to a rollout are the merged ones (`named_policy_weights`), a
                            checkpoint holds the adapters only and records their shape,
                            and the export is a PEFT adapter directory

Invariants: collective methods are called on every rank (the checkpoint store and the
stage host do so); `group` is None exactly when the model is not sharded; a checkpoint
loads only into a role with the same LoRA shape (or none on both sides), else a
ConfigError names both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from hybridflow.errors import ConfigError
from hybridflow.models.loader import ModelOptions
from hybridflow.models.lora import Adapters, LoraOptions, wrap
from hybridflow.stages.base import StageContext
from hybridflow.stages.common import mix_seed, model_state, options_path
from hybridflow.stages.parallel import checkpoint as shard_ckpt
from hybridflow.stages.parallel.fsdp import full_weights, shard_model
from hybridflow.stages.parallel.group import Group, join
from hybridflow.stages.parallel.options import ShardingOptions, sharded


class ShardedModelRole:
    model: Any
    device: torch.device
    group: Group | None = None
    adapters: Adapters | None = None  # set: LoRA, only the adapters train

    def add_adapters(self, ctx: StageContext, opts: LoraOptions, kind: str) -> None:
        """Wrap the model in LoRA adapters when `opts` ask (before `shard_if_asked`:
        FSDP then shards base and adapters alike). Every rank seeds A alike."""
        self.adapters = wrap(
            self.model, opts, kind=kind, seed=mix_seed(ctx.seed, "lora"), path=options_path(ctx)
        )
        if self.adapters is not None:
            trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in self.model.parameters())
            ctx.log.info(
                "%s: LoRA rank %d on %s: %d of %d parameters train",
                ctx.world.role,
                opts.lora_rank,
                ",".join(self.adapters.targets),
                trained,
                total,
            )

    def shard_if_asked(self, ctx: StageContext, opts: ShardingOptions, *, trainable: bool) -> None:
        replicas = ctx.world.world_size
        if not sharded(opts.fsdp, trainable=trainable, replicas=replicas):
            return
        self.group = join(ctx.world, ctx.device)
        shard_model(self.model, self.group, opts)
        ctx.log.info(
            "%s: FSDP rank %d of %d on %s",
            ctx.world.role,
            self.group.rank,
            self.group.world_size,
            ctx.device,
        )

    @property
    def is_sharded(self) -> bool:
        return self.group is not None

    @property
    def writes_shards(self) -> bool:
        """Whether the checkpoint store saves this role's weights and optimizer moments
        through `save_shards` (every trainer role, sharded or not)."""
        return getattr(self, "trainer", None) is not None

    def base_model_for(
        self, opts: ModelOptions, *, kind: str, sharded: bool
    ) -> tuple[Any, Callable[[], AbstractContextManager[None]]] | str:
        """The model a frozen role built from `opts` (as `kind`) would hold, as this
        role's model plus the context that runs it with the adapters disabled; or why
        not, as text. `sharded`: whether that role runs every task on every rank (a
        forward of a sharded model is collective)."""
        if self.adapters is None:
            return "it has no LoRA adapters (lora_rank 0): its weights are not the base's"
        if self.adapters.kind != kind:
            return f"its model is a {self.adapters.kind} model, not a {kind} one"
        mine = getattr(self, "opts", None)
        differ = [
            f.name
            for f in fields(ModelOptions)
            if getattr(mine, f.name, None) != getattr(opts, f.name)
        ]
        if differ:
            return f"its model options differ in {', '.join(differ)}"
        if self.group is not None and not sharded:
            return "it is FSDP-sharded: set `fsdp: true` on the reference too (its forward is collective)"
        return self.model, self.adapters.disabled

    def named_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        # Unsharded, each tensor is the parameter itself (detached, no copy).
        yield from full_weights(self.model, self.device)

    def named_policy_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What a rollout engine loads: the full weights under the base model's names,
        adapters merged (W + scaling * B @ A, a copy per adapted layer) under LoRA."""
        if self.adapters is None:
            yield from self.named_full_weights()
        else:
            yield from self.adapters.merged(self.named_full_weights())

    def _optimizer(self) -> torch.optim.Optimizer:
        trainer = getattr(self, "trainer", None)
        assert trainer is not None, "save_shards/load_shards need a trainer"
        return trainer.optimizer

    def save_shards(self, directory: Path) -> dict[str, Any]:
        extra = shard_ckpt.save(
            self.model,
            self._optimizer(),
            directory,
            alone=self.group is None,
            trainable_only=self.adapters is not None,
        )
        extra["lora"] = None if self.adapters is None else self.adapters.describe()
        return extra

    def load_shards(self, directory: Path, extra: dict[str, Any]) -> None:
        saved = extra.get("lora")  # absent in checkpoints older than LoRA: full weights
        mine = None if self.adapters is None else self.adapters.describe()
        if saved != mine:
            raise ConfigError(
                "resume_from",
                f"checkpoint {directory} holds {_trains(saved)}, but this run's role "
                f"trains {_trains(mine)}: resume with the lora_* options it was written "
                "with (lora_rank, lora_alpha, lora_target_modules), or start a new run",
            )
        shard_ckpt.load(
            self.model,
            self._optimizer(),
            directory,
            extra,
            alone=self.group is None,
            trainable_only=self.adapters is not None,
        )

    def export_pretrained(self, directory: Path, *, write: bool) -> None:
        """The whole model as a `save_pretrained` directory (collective when sharded;
        only `write` ranks write)."""
        from hybridflow.models.loader import save_pretrained

        state = None
        if self.group is None and self.adapters is not None:
            state = model_state(self.model)  # adapters and the base: merged export
        elif self.group is not None:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            state = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        if not write:
            return
        tokenizer = getattr(self, "tokenizer", None)
        if self.adapters is None:
            save_pretrained(self.model, tokenizer, directory, state_dict=state)
            return
        assert state is not None
        self.adapters.save(directory, state)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
        if getattr(getattr(self, "opts", None), "lora_export_merged", False):
            merged = dict(self.adapters.merged(iter(state.items())))
            save_pretrained(self.model, tokenizer, directory / "merged", state_dict=merged)


def _trains(lora: dict[str, Any] | None) -> str:
    if lora is None:
        return "all weights (no LoRA)"
    return (
        f"LoRA adapters (lora_rank {lora['rank']}, lora_alpha {lora['alpha']}, targets "
        f"{', '.join(lora['targets'])})"
    )

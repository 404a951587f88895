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

Invariants: collective methods are called on every rank (the checkpoint store and the
stage host do so); `group` is None exactly when the model is not sharded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hybridflow.stages.base import StageContext
from hybridflow.stages.parallel import checkpoint as shard_ckpt
from hybridflow.stages.parallel.fsdp import full_weights, shard_model
from hybridflow.stages.parallel.group import Group, join
from hybridflow.stages.parallel.options import ShardingOptions, sharded


class ShardedModelRole:
    model: Any
    device: torch.device
    group: Group | None = None

    def shard_if_asked(self, ctx: StageContext, opts: ShardingOptions, *, trainable: bool) -> None:
        replicas = int(ctx.world.get("world_size", 1))
        if not sharded(opts.fsdp, trainable=trainable, replicas=replicas):
            return
        self.group = join(ctx.world, ctx.device)
        shard_model(self.model, self.group, opts)
        ctx.log.info(
            "%s: FSDP rank %d of %d on %s",
            ctx.world.get("role"),
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

    def named_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        # Unsharded, each tensor is the parameter itself (detached, no copy).
        yield from full_weights(self.model, self.device)

    def _optimizer(self) -> torch.optim.Optimizer:
        trainer = getattr(self, "trainer", None)
        assert trainer is not None, "save_shards/load_shards need a trainer"
        return trainer.optimizer

    def save_shards(self, directory: Path) -> dict[str, Any]:
        return shard_ckpt.save(self.model, self._optimizer(), directory, alone=self.group is None)

    def load_shards(self, directory: Path, extra: dict[str, Any]) -> None:
        shard_ckpt.load(self.model, self._optimizer(), directory, extra, alone=self.group is None)

    def export_pretrained(self, directory: Path, *, write: bool) -> None:
        """The whole model as a `save_pretrained` directory (collective when sharded;
        only `write` ranks write)."""
        from hybridflow.models.loader import save_pretrained

        state = None
        if self.group is not None:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            state = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        if write:
            save_pretrained(
                self.model, getattr(self, "tokenizer", None), directory, state_dict=state
            )

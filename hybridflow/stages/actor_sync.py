"""What the actor sends a rollout engine, and how (the `PolicySender` mixin of stages/actor.py):
the colocated `reshard`, the disaggregated stream's `weight_buckets` and the coordinator's
`export_weights`.

Three forms of one update (models/lora.py names the parameters):
  merged    the base model's names, full size, LoRA adapters merged (W + scaling * B @ A):
            what every engine loads unchanged. Full fine-tuning, and LoRA with
            `lora_sync: merged` (the default), send this at every sync.
  full      under LoRA with `lora_sync: adapters`: every parameter of the wrapped model
            under its own names (base_layer, lora_A/B, the rest), the first sync on a
            channel; it makes the rollout's base the actor's, bit for bit;
  adapters  then only the lora_A / lora_B weights (the base is frozen): a few MB.
A rollout taking `full`/`adapters` holds the adapters unmerged (stages/rollout/adapters.py
for hf and native, stages/rollout/vllm_lora.py for vLLM's LoRA support); the plan wraps it
(pipeline/plan/weight_links.py `adapter_syncs`) and refuses a backend that cannot (a vLLM
installation without LoRA support, with the reason).

Channels: `colocated` (reshard into the rollout in this process) and `stream` (the weight
link to other stages). Each sends `full` once, then `adapters`; a channel counts as served
once an update has gone through it whole (a failed one is sent full again). Every rank of a
sharded actor walks the same buckets (gathers are collective), so their channels agree.
`export_weights` always sends `merged` (the coordinator feeds whatever rollout asks).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hybridflow.errors import BatchError
from hybridflow.models.lora import is_adapter
from hybridflow.stages.base import Batch, Metrics
from hybridflow.stages.parallel.fsdp import gather


class PolicySender:
    """Mixed into the actor (a ShardedModelRole with `opts`, `ctx`, `version`)."""

    opts: Any
    ctx: Any
    model: Any
    device: torch.device
    version: int
    adapters: Any
    _channels: set[str]  # the channels an update went through whole

    def named_weights(self, form: str = "merged") -> Iterator[tuple[str, torch.Tensor]]:
        """(name, detached tensor on the training device), one parameter at a time; tied
        parameters appear once. `form`: merged | full | adapters (module docstring)."""
        if form == "merged":
            yield from self.named_policy_weights()  # type: ignore[attr-defined]
        elif form == "full":
            yield from self.named_full_weights()  # type: ignore[attr-defined]
        else:  # gather only the adapters (collective per parameter under FSDP)
            for name, p in self.model.named_parameters():
                if is_adapter(name):
                    yield name, gather(p.detach(), self.device)

    def sync_form(self, channel: str) -> str:
        """The form the next update on `channel` (colocated | stream) takes."""
        if self.adapters is None or self.opts.lora_sync != "adapters":
            return "merged"
        return "adapters" if channel in self._served() else "full"

    def _served(self) -> set[str]:
        return self._channels

    def weight_buckets(self, bucket_bytes: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """The stream's update grouped into buckets of whole parameters, <= `bucket_bytes`
        each (a parameter larger than that is a bucket of its own). Deterministic order."""
        yield from self._buckets(self.sync_form("stream"), bucket_bytes)
        self._served().add("stream")

    def _buckets(self, form: str, bucket_bytes: int | None) -> Iterator[dict[str, torch.Tensor]]:
        limit = bucket_bytes or int(self.opts.weight_bucket_mb * (1 << 20))
        yield from size_buckets(self.named_weights(form), limit)

    def reshard(self, version: Any = None) -> Metrics:
        target = self.ctx.colocated.get(self.opts.rollout_role)
        if target is None or not type(target).receives_weights:
            raise BatchError(
                f"actor.reshard: no colocated rollout role {self.opts.rollout_role!r} with "
                f"update_weights (colocated: {sorted(self.ctx.colocated)}); with the rollout "
                "in another stage, add the step op `{role: rollout, op: load_weights, scope: "
                "step}` (no inputs) to the dataflow: reshard then streams the weights to it"
            )
        v = self.version if version is None else int(version)
        form = self.sync_form("colocated")
        metrics = dict(target.update_weights(self.named_weights(form), version=v))
        self._served().add("colocated")
        return metrics

    def export_weights(self, bucket: int) -> tuple[Batch, Metrics]:
        buckets = list(self._buckets("merged", None))
        if bucket >= len(buckets) or bucket < -1:
            raise BatchError(f"actor.export_weights: bucket {bucket} of {len(buckets)}")
        chosen = buckets if bucket == -1 else [buckets[bucket]]
        out = {k: v.to("cpu", copy=True) for b in chosen for k, v in b.items()}
        nbytes = sum(v.numel() * v.element_size() for v in out.values())
        return out, {"weights/num_buckets": float(len(buckets)), "weights/bytes": float(nbytes)}


def size_buckets(
    named: Iterable[tuple[str, torch.Tensor]], limit: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Whole tensors in order, grouped into buckets of <= `limit` bytes (a tensor larger
    than that is a bucket of its own)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket

"""`python bench/lora_reshard.py [--presets tiny small] [--ranks 8 64] [--sync merged adapters]
[--reps 5] [--shapes qwen2-0.5b]`: what a weight sync costs with LoRA against full
fine-tuning, per model preset, LoRA rank and `lora_sync` (CPU).

For each preset, a real actor role (fp32, all-linear targets) without LoRA and with each
rank, and per sync mode; per configuration it prints one JSON object:
  {"preset", "lora_rank", "sync", "params", "trained_params",
   "sent_bytes"      bytes one sync hands the rollout. merged (and full fine-tuning): the
                     merged weights under the base names, every sync; adapters: the
                     lora_A / lora_B tensors, every sync after the first,
   "first_bytes"     (adapters) bytes of the first sync: the whole wrapped model,
   "adapter_bytes"   bytes of the adapters alone,
   "named_weights_s" best time to produce what one sync sends (merged: the merge W +
                     scaling * B @ A of every adapted layer; adapters: detached views),
   "colocated_s"     best time of HFRollout.update_weights(...) of one sync (adapters: into
                     a rollout holding the adapters unmerged, after its first full sync),
   "first_sync_s"    (adapters) the time of that first full sync}
`--shapes P...`: bytes only (merged, first, adapter-only sync) of presets built on the meta
device (no memory, no download: e.g. qwen2-0.5b, qwen2-7b), one JSON object per rank.
Times are minima over `--reps` after a warm-up, one torch thread (see
hybridflow/bench/reshard.py on why): compare within one run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from hybridflow.bench.reshard import best_of, meta_model
from hybridflow.models.lora import SHAPE_KEYS, LoraOptions, is_adapter, wrap
from hybridflow.stages.actor import Actor
from hybridflow.stages.base import StageContext, StageWorld
from hybridflow.stages.rollout.hf import HFRollout


def _role(cls: type, options: dict[str, Any], name: str) -> Any:
    ctx = StageContext(
        stage=name,
        replica=0,
        device=torch.device("cpu"),
        seed=0,
        run_dir=Path("/nonexistent"),
        options=options,
        world=StageWorld(role=name),
    )
    role = cls()
    role.setup(ctx)
    return role


def _nbytes(pairs: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in pairs)


def measure(preset: str, rank: int, reps: int, rollout: Any) -> dict[str, Any]:
    actor = _role(Actor, {"model": preset, "lora_rank": rank}, "actor")
    params = list(actor.model.parameters())
    trained = [p for p in params if p.requires_grad]
    return {
        "preset": preset,
        "lora_rank": rank,
        "sync": "merged",
        "params": sum(p.numel() for p in params),
        "trained_params": sum(p.numel() for p in trained),
        "sent_bytes": _nbytes(actor.named_weights()),
        "adapter_bytes": sum(p.numel() * p.element_size() for p in trained) if rank else 0,
        "named_weights_s": best_of(lambda: sum(1 for _ in actor.named_weights()), reps),
        "colocated_s": best_of(lambda: rollout.update_weights(actor.named_weights()), reps),
    }


def measure_adapters(preset: str, rank: int, reps: int) -> dict[str, Any]:
    """`lora_sync: adapters`: a rollout holding the adapters, fed one full sync, then
    adapter-only ones."""
    actor = _role(Actor, {"model": preset, "lora_rank": rank, "lora_sync": "adapters"}, "actor")
    rollout = _role(HFRollout, {"model": preset}, "rollout")
    rollout.hold_adapters({k: getattr(actor.opts, k) for k in SHAPE_KEYS}, 0)
    params = list(actor.model.parameters())
    trained = [p for p in params if p.requires_grad]
    t0 = time.perf_counter()
    rollout.update_weights(actor.named_weights("full"))
    first_s = time.perf_counter() - t0
    sent = _nbytes(actor.named_weights("adapters"))
    return {
        "preset": preset,
        "lora_rank": rank,
        "sync": "adapters",
        "params": sum(p.numel() for p in params),
        "trained_params": sum(p.numel() for p in trained),
        "sent_bytes": sent,
        "first_bytes": _nbytes(actor.named_weights("full")),
        "adapter_bytes": sent,
        "named_weights_s": best_of(lambda: sum(1 for _ in actor.named_weights("adapters")), reps),
        "colocated_s": best_of(
            lambda: rollout.update_weights(actor.named_weights("adapters")), reps
        ),
        "first_sync_s": first_s,
    }


def shape_bytes(preset: str, rank: int) -> dict[str, Any]:
    """Bytes per sync of `preset` (fp32) at `rank`, from a model on the meta device."""
    model = meta_model(preset)
    merged = _nbytes(model.named_parameters())
    wrap(model, LoraOptions(lora_rank=rank), kind="causal_lm", seed=0, path="shapes")
    named = list(model.named_parameters())
    return {
        "preset": preset,
        "lora_rank": rank,
        "merged_bytes": merged,
        "first_bytes": _nbytes(named),
        "adapter_bytes": _nbytes((n, t) for n, t in named if is_adapter(n)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--presets", nargs="*", default=["tiny", "small"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[8, 64])
    ap.add_argument(
        "--sync", nargs="+", choices=["merged", "adapters"], default=["merged", "adapters"]
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", nargs="*", default=[], help="bytes only, meta-device models")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for preset in args.presets:
        if "merged" in args.sync:
            rollout = _role(HFRollout, {"model": preset}, "rollout")
            for rank in [0, *args.ranks]:
                print(json.dumps(measure(preset, rank, args.reps, rollout)), flush=True)
        if "adapters" in args.sync:
            for rank in args.ranks:
                print(json.dumps(measure_adapters(preset, rank, args.reps)), flush=True)
    for preset in args.shapes:
        for rank in args.ranks:
            print(json.dumps(shape_bytes(preset, rank)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

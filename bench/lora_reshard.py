"""`python bench/lora_reshard.py [--presets tiny small] [--ranks 8 64] [--reps 5]`: what a
reshard costs with LoRA against full fine-tuning, per model preset and LoRA rank (CPU).

For each preset, a real actor role (fp32, all-linear targets) without LoRA and with each
rank; per configuration it prints one JSON object:
  {"preset", "lora_rank", "params", "trained_params",
   "sent_bytes"      bytes one reshard hands the rollout (merged weights under the base
                     names: option (a) of issue 24; the same as full fine-tuning's),
   "adapter_bytes"   bytes of the adapters alone (what an adapter-only stream would send;
                     not built here),
   "named_weights_s" best time to produce the weights the reshard sends (the merge
                     W + scaling * B @ A of every adapted layer, or plain detached views),
   "colocated_s"     best time of HFRollout.update_weights(actor.named_weights())}
Times are minima over `--reps` after a warm-up, one torch thread (see
hybridflow/bench/reshard.py on why): compare within one run, not across runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from hybridflow.bench.reshard import best_of
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


def measure(preset: str, rank: int, reps: int, rollout: Any) -> dict[str, Any]:
    actor = _role(Actor, {"model": preset, "lora_rank": rank}, "actor")
    params = list(actor.model.parameters())
    trained = [p for p in params if p.requires_grad]
    sent = sum(t.numel() * t.element_size() for _, t in actor.named_weights())
    return {
        "preset": preset,
        "lora_rank": rank,
        "params": sum(p.numel() for p in params),
        "trained_params": sum(p.numel() for p in trained),
        "sent_bytes": sent,
        "adapter_bytes": sum(p.numel() * p.element_size() for p in trained) if rank else 0,
        "named_weights_s": best_of(lambda: sum(1 for _ in actor.named_weights()), reps),
        "colocated_s": best_of(lambda: rollout.update_weights(actor.named_weights()), reps),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[8, 64])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for preset in args.presets:
        rollout = _role(HFRollout, {"model": preset}, "rollout")
        for rank in [0, *args.ranks]:
            print(json.dumps(measure(preset, rank, args.reps, rollout)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

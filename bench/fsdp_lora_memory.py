"""`python bench/fsdp_lora_memory.py [--presets small] [--worlds 1 2] [--ranks 0 8 64]
[--rows 4] [--prompt-len 8] [--response-len 24]`: what one FSDP rank of the actor holds,
full fine-tuning against LoRA (all-linear), per world size (issue 24), on CPU.

Per (preset, lora_rank, world) it spawns `world` gloo ranks (a fresh set of processes
each, file:// rendezvous, as tests/stages/fsdp_helpers.py does); every rank builds the
real actor role (`Actor.setup`: the model, LoRA's `wrap`, `shard_model`'s FSDP2 wrapping
with `fsdp: true`, so world 1 runs the same path), takes its share of one `--rows`-row
micro-batch through `update`, then `optimizer_step` (one AdamW update), and counts bytes
by accounting, not by RSS:
  params_bytes      its local parameter shards (DTensor.to_local), frozen base included
  trainable_bytes   the part of those that requires grad
  grad_bytes        its local gradient shards after `update` (before the step frees them)
  optimizer_bytes   its AdamW exp_avg + exp_avg_sq (local shards) after the step
  setup_peak_rss_delta_mib, step_peak_rss_delta_mib  (secondary) the process's peak
                    RSS (VmHWM) during `setup`, then during `update` + `optimizer_step`
                    (reset between), minus VmRSS before the role was built (after a
                    warm-up role on `tiny`: imports, the group): activations, gathered
                    layers and allocator slack in
One JSON object per configuration: {"preset", "params" (whole model), "trained_params",
"lora_rank", "world", "ranks": [per rank: the fields above], "total": sums over ranks}.
One torch thread per rank (2-core machines); the peak RSS varies run to run, bytes do not.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

_VOCAB = 192  # token ids below the built-in tokenizer's size: every preset embeds them


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def _global_numel(t: torch.Tensor) -> int:
    return t.numel()  # a DTensor's numel is the whole tensor's


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _batch(rows: int, prompt_len: int, response_len: int, vocab: int) -> dict[str, torch.Tensor]:
    """One micro-batch of random tokens (no padding), seeded: every rank builds the same
    and takes its rows (the scheduler's shard_rows)."""
    g = torch.Generator().manual_seed(0)
    return {
        "prompt_ids": torch.randint(0, vocab, (rows, prompt_len), generator=g),
        "prompt_mask": torch.ones(rows, prompt_len, dtype=torch.long),
        "response_ids": torch.randint(0, vocab, (rows, response_len), generator=g),
        "response_mask": torch.ones(rows, response_len, dtype=torch.long),
        "advantages": torch.randn(rows, response_len, generator=g),
    }


def _actor(cfg: dict[str, Any], rank: int, world: int, init_method: str) -> Any:
    from hybridflow.stages.actor import Actor
    from hybridflow.stages.base import StageContext, StageWorld

    options = {
        "model": cfg["preset"],
        "fsdp": True,
        "lora_rank": cfg["lora_rank"],
        "lr": 1e-4,
        "forward_batch_size": cfg["rows"],
    }
    ctx = StageContext(
        stage="actor",
        replica=rank,
        device=torch.device("cpu"),
        seed=0,
        run_dir=Path("/nonexistent"),
        options=options,
        world=StageWorld(role="actor", rank=rank, world_size=world, init_method=init_method),
    )
    role = Actor()
    role.setup(ctx)
    return role


def _rank_main(rank: int, world: int, init_method: str, cfg: dict[str, Any], out: str) -> None:
    from hybridflow.pipeline.runtime.steps import shard_rows
    from hybridflow.stages.parallel.group import exit_rank

    torch.set_num_threads(1)
    mb = _batch(cfg["rows"], cfg["prompt_len"], cfg["response_len"], _VOCAB)
    # Warm-up on `tiny` (same LoRA rank): the lazy imports (transformers' model classes,
    # peft, FSDP), the group's join and autograd's first-use buffers land before the
    # baseline, so the RSS delta is the model's and its step's.
    warm = _actor({**cfg, "preset": "tiny"}, rank, world, init_method)
    warm.handle("update", shard_rows(mb, world, rank), {})
    warm.handle("optimizer_step", {}, {})
    del warm
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
    rss0 = _status_kib("VmRSS")
    role = _actor(cfg, rank, world, init_method)
    setup_peak = _status_kib("VmHWM")  # the build: every rank's whole model, then shards
    Path("/proc/self/clear_refs").write_text("5")
    params = list(role.model.parameters())
    role.handle("update", shard_rows(mb, world, rank), {})
    grads = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    role.handle("optimizer_step", {}, {})
    state = role.trainer.optimizer.state.values()
    moments = sum(_local_bytes(s[k]) for s in state for k in ("exp_avg", "exp_avg_sq") if k in s)
    report = {
        "rank": rank,
        "params_bytes": sum(_local_bytes(p) for p in params),
        "trainable_bytes": sum(_local_bytes(p) for p in params if p.requires_grad),
        "grad_bytes": grads,
        "optimizer_bytes": moments,
        "setup_peak_rss_delta_mib": round((setup_peak - rss0) / 1024, 1),
        "step_peak_rss_delta_mib": round((_status_kib("VmHWM") - rss0) / 1024, 1),
        "params": sum(_global_numel(p) for p in params),
        "trained_params": sum(_global_numel(p) for p in params if p.requires_grad),
        "sharded": all(type(p).__name__ == "DTensor" for p in params),
    }
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))
    exit_rank()


def measure(cfg: dict[str, Any], world: int) -> dict[str, Any]:
    """One configuration on `world` freshly spawned ranks -> its JSON object."""
    with tempfile.TemporaryDirectory(prefix="fsdp-lora-mem-") as tmp:
        torch.multiprocessing.spawn(
            _rank_main,
            args=(world, f"file://{tmp}/rendezvous", cfg, tmp),
            nprocs=world,
            join=True,
        )
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
    params, trained = ranks[0]["params"], ranks[0]["trained_params"]
    keys = ("params_bytes", "trainable_bytes", "grad_bytes", "optimizer_bytes")
    for r in ranks:
        assert r["sharded"], f"rank {r['rank']}: some parameters are not DTensors"
        for k in ("params", "trained_params", "sharded"):
            del r[k]
    return {
        "preset": cfg["preset"],
        "params": params,
        "trained_params": trained,
        "lora_rank": cfg["lora_rank"],
        "world": world,
        "rows": cfg["rows"],
        "tokens_per_row": cfg["prompt_len"] + cfg["response_len"],
        "ranks": ranks,
        "total": {k: sum(r[k] for r in ranks) for k in keys},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["small"])
    ap.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--ranks", nargs="+", type=int, default=[0, 8, 64], help="0: full FT")
    ap.add_argument("--rows", type=int, default=4, help="rows of the micro-batch (all ranks)")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--response-len", type=int, default=24)
    args = ap.parse_args(argv)
    for preset in args.presets:
        for lora_rank in args.ranks:
            cfg = {
                "preset": preset,
                "lora_rank": lora_rank,
                "rows": args.rows,
                "prompt_len": args.prompt_len,
                "response_len": args.response_len,
            }
            for world in args.worlds:
                print(json.dumps(measure(cfg, world)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Run a role as N FSDP ranks on CPU (gloo) in spawned processes, against one process.

`run_ranks` spawns `world` processes, each setting up the role as rank r of one group
(the rendezvous a replicated stage gets from the launcher), feeding it its share of the
rows of every micro-batch (the scheduler's `shard_rows`), for `steps` optimizer steps;
rank 0 writes the full weights and every step's metrics to `out` (safetensors + JSON).
Checkpoints go through the role's `save_shards` / `load_shards`, as the store does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from stage_helpers import make_role

from hybridflow.pipeline.runtime.scheduler import shard_rows
from hybridflow.stages.actor import Actor
from hybridflow.stages.critic import Critic
from hybridflow.stages.reference import Reference

ROLES = {"actor": Actor, "critic": Critic, "reference": Reference}


def train(
    role: Any,
    micro_batches: list[dict[str, torch.Tensor]],
    steps: int,
    world: int = 1,
    rank: int = 0,
) -> list[dict[str, float]]:
    out = []
    for _ in range(steps):
        for mb in micro_batches:
            role.handle("update", shard_rows(mb, world, rank), {})
        out.append(role.handle("optimizer_step", {}, {})[1])
    return out


def full_weights(role: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in role.named_full_weights()}


def _rank_main(
    rank: int,
    world: int,
    init_method: str,
    kind: str,
    options: dict[str, Any],
    micro_batches: list[dict[str, torch.Tensor]],
    steps: int,
    out: str,
    load_from: str,
    save_to: str,
    cuda: bool,
) -> None:
    torch.set_num_threads(1)
    role = make_role(
        ROLES[kind],
        kind,
        options,
        device=torch.device("cuda", rank) if cuda else torch.device("cpu"),
        replica=rank,
        world={"role": kind, "rank": rank, "world_size": world, "init_method": init_method},
    )
    if load_from:
        state = json.loads((Path(load_from) / "state.json").read_text())
        role.load_shards(Path(load_from) / "shards", state["extra"])
    if kind == "reference":  # frozen: its sharded forward only, each rank's share
        outs = [
            role.handle("get_logprob", shard_rows(mb, world, rank), {})[0] for mb in micro_batches
        ]
        save_file(
            {f"mb{i}": o["ref_logprobs"] for i, o in enumerate(outs)},
            str(Path(out) / f"ref{rank}.safetensors"),
        )
    metrics = train(role, micro_batches, steps, world, rank)
    if save_to:
        extra = role.save_shards(Path(save_to) / "shards")
        if rank == 0:
            (Path(save_to) / "state.json").write_text(json.dumps({"extra": extra}))
    weights = full_weights(role)  # collective: every rank gathers
    if rank == 0:
        save_file(weights, str(Path(out) / "weights.safetensors"))
        (Path(out) / "metrics.json").write_text(json.dumps(metrics))
    from hybridflow.stages.parallel.group import exit_rank

    exit_rank()


def run_ranks(
    world: int,
    kind: str,
    options: dict[str, Any],
    micro_batches: list[dict[str, torch.Tensor]],
    steps: int,
    out: Path,
    load_from: Path | None = None,
    save_to: Path | None = None,
    cuda: bool = False,
) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    out.mkdir(parents=True, exist_ok=True)
    torch.multiprocessing.spawn(
        _rank_main,
        args=(
            world,
            f"file://{out}/rendezvous",  # no port to pick (and race for)
            kind,
            options,
            micro_batches,
            steps,
            str(out),
            str(load_from or ""),
            str(save_to or ""),
            cuda,  # rank r on cuda:r (NCCL) instead of the CPU (gloo)
        ),
        nprocs=world,
        join=True,
    )
    weights = load_file(str(out / "weights.safetensors"))
    return weights, json.loads((out / "metrics.json").read_text())

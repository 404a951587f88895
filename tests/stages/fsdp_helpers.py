"""Run a role as N FSDP ranks on CPU (gloo) in spawned processes, against one process.

`run_ranks` spawns `world` processes, each setting up the role as rank r of one group
(the rendezvous a replicated stage gets from the launcher), feeding it its share of the
rows of every micro-batch (the scheduler's `shard_rows`), for `steps` optimizer steps;
rank 0 writes the full weights and every step's metrics to `out` (safetensors + JSON).
Checkpoints go through the role's `save_shards` / `load_shards`, as the store does.
`run_jobs` runs several such jobs on one spawn of the ranks (a spawn costs seconds).
A job with `syncs` also takes the actor's weight stream (`weight_buckets`) before its
first step and after its last; every rank writes what it would send (`sync_payloads`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from stage_helpers import make_role

from hybridflow.pipeline.runtime.scheduler import shard_rows
from hybridflow.stages.actor import Actor
from hybridflow.stages.base import StageWorld
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


@dataclass(frozen=True)
class Job:
    """One role set up on every rank and driven for `steps` optimizer steps; its results
    land in `out` (see `run_jobs`)."""

    kind: str
    options: dict[str, Any]
    micro_batches: list[dict[str, torch.Tensor]]
    steps: int
    out: Path
    load_from: Path | None = None
    save_to: Path | None = None
    syncs: bool = False  # the actor's stream update before the first step and after the last


def _sync(role: Any, out: Path, rank: int, when: str) -> None:
    """One stream update (collective), every bucket merged, as rank `rank` would send it."""
    payload = {k: v.detach().cpu().clone() for b in role.weight_buckets() for k, v in b.items()}
    save_file(payload, str(out / f"sync-{when}-{rank}.safetensors"))


def sync_payloads(job: Job, world: int, when: str) -> list[dict[str, torch.Tensor]]:
    """Each rank's stream update of a `syncs` job: `when` is "first" or "last"."""
    return [load_file(str(job.out / f"sync-{when}-{r}.safetensors")) for r in range(world)]


def _run_job(rank: int, world: int, init_method: str, job: Job, cuda: bool) -> None:
    role = make_role(
        ROLES[job.kind],
        job.kind,
        job.options,
        device=torch.device("cuda", rank) if cuda else torch.device("cpu"),
        replica=rank,
        world=StageWorld(role=job.kind, rank=rank, world_size=world, init_method=init_method),
    )
    if job.load_from:
        state = json.loads((job.load_from / "state.json").read_text())
        role.load_shards(job.load_from / "shards", state["extra"])
    if job.kind == "reference":  # frozen: its sharded forward only, each rank's share
        outs = [
            role.handle("get_logprob", shard_rows(mb, world, rank), {})[0]
            for mb in job.micro_batches
        ]
        save_file(
            {f"mb{i}": o["ref_logprobs"] for i, o in enumerate(outs)},
            str(job.out / f"ref{rank}.safetensors"),
        )
    if job.syncs:
        _sync(role, job.out, rank, "first")
    metrics = train(role, job.micro_batches, job.steps, world, rank)
    if job.syncs:
        _sync(role, job.out, rank, "last")
    if job.save_to:
        extra = role.save_shards(job.save_to / "shards")
        if rank == 0:
            (job.save_to / "state.json").write_text(json.dumps({"extra": extra}))
    weights = full_weights(role)  # collective: every rank gathers
    if rank == 0:
        save_file(weights, str(job.out / "weights.safetensors"))
        (job.out / "metrics.json").write_text(json.dumps(metrics))


def _rank_main(rank: int, world: int, init_method: str, jobs: list[Job], cuda: bool) -> None:
    torch.set_num_threads(1)
    for job in jobs:  # one group for all: `group.join` reuses it for every job's role
        _run_job(rank, world, init_method, job, cuda)
    from hybridflow.stages.parallel.group import exit_rank

    exit_rank()


def run_jobs(
    world: int, jobs: list[Job], cuda: bool = False
) -> list[tuple[dict[str, torch.Tensor], list[dict[str, float]]]]:
    """Run `jobs` one after another on the same `world` spawned ranks: a spawn (a fresh
    interpreter importing torch, transformers and the roles, then the rendezvous) costs
    far more on CPU than a job on the tiny model, so a test module spawns once for all
    its jobs. Each job's role is set up afresh (its own seeded init), as in its own
    processes. Returns each job's (full weights, per-step metrics) from rank 0."""
    for job in jobs:
        job.out.mkdir(parents=True, exist_ok=True)
    torch.multiprocessing.spawn(
        _rank_main,
        args=(
            world,
            f"file://{jobs[0].out}/rendezvous",  # no port to pick (and race for)
            jobs,
            cuda,  # rank r on cuda:r (NCCL) instead of the CPU (gloo)
        ),
        nprocs=world,
        join=True,
    )
    return [
        (
            load_file(str(job.out / "weights.safetensors")),
            json.loads((job.out / "metrics.json").read_text()),
        )
        for job in jobs
    ]


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
    """One job on its own `world` ranks (see `run_jobs`)."""
    job = Job(kind, options, micro_batches, steps, out, load_from, save_to)
    return run_jobs(world, [job], cuda)[0]

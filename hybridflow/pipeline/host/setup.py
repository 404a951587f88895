"""A stage process's SETUP state: connect its weight-link peers, build and set up every role,
restore a checkpoint. Runs in the worker thread where role code runs, while the process's
loop keeps heartbeating (model loading may take minutes).

What a role gets in `StageContext.world` (a typed `StageWorld`, stages/base.py): its role
name and kind, `rank` (= replica) and `world_size` (= replicas of this stage), the
rendezvous of the stage's replicas (`init_method`, "" when there is one; replica 0 also
inherits its listening socket, `init_listen_fd`), `run_id`, and `dataflow`: op -> `OpIO`
(inputs, outputs, scope) for every op of this role. `ctx.seed` is the run seed, the same
in every stage (actor and reference build identical initial weights from it); derive
per-purpose streams from it. `ctx.colocated` holds every role of this process (the hybrid
engine's in-process hand-off); they are all constructed before any `setup`, in config
order, and a role's `bind_colocated()` (when it has one) runs once every setup has
returned; before it, a rollout fed a LoRA actor's adapters (`lora_sync: adapters`) is
told to hold them (`hold_adapters`, pipeline/plan/weight_links.py `adapter_syncs`). With
`resume_dir`, every role's state and the process's RNG are restored right after
(pipeline/checkpoint/stage.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from hybridflow.config.schema import RoleConfig, Topology
from hybridflow.pipeline.checkpoint import stage as checkpoint
from hybridflow.pipeline.host.failures import interrupted
from hybridflow.pipeline.host.launch_spec import LaunchSpec
from hybridflow.pipeline.host.weight_sync import StageWeightSync
from hybridflow.pipeline.host.worker import Worker
from hybridflow.pipeline.plan.planner import role_ops
from hybridflow.pipeline.plan.weight_links import adapter_syncs
from hybridflow.stages import StageContext, create_role
from hybridflow.stages.base import Role, StageWorld

log = logging.getLogger("hybridflow.stage")


class SetupFailed(Exception):
    """Setup failed in `part` ("device", "weight_sync", a role's name, "checkpoint");
    the cause is `__cause__`, whatever it was (any BaseException but an interrupt)."""

    def __init__(self, part: str) -> None:
        super().__init__(part)
        self.part = part


async def set_up(
    spec: LaunchSpec,
    topo: Topology,
    *,
    secret: bytes,
    config_hash: str,
    worker: Worker,
    roles: dict[str, Role],
    keep_weight_sync: Callable[[StageWeightSync], None],
) -> torch.device:
    """Fill `roles` (in place: what was built before a failure is still closed by the
    caller) and hand the weight-sync ends to `keep_weight_sync` as soon as they exist.
    -> the stage's device. Raises SetupFailed naming the part that failed."""
    cfg = topo.stages[spec.stage]
    part = "device"
    try:
        device = torch.device(cfg.device_of(spec.replica))
        if device.type == "cuda":
            # The current CUDA device is per thread and starts as cuda:0: make it this
            # stage's in the loop thread and in the worker thread, so code that captures
            # or allocates on the "current" device (CUDA graphs, NCCL) lands on the
            # stage's GPU. (Seen on two GPUs: a native rollout on cuda:1 failed its graph
            # capture at setup.)
            torch.cuda.set_device(device)
            await worker.call(torch.cuda.set_device, device)
        part = "weight_sync"  # connect weight-sync peers first: they meet while models load
        weight_sync = StageWeightSync.for_stage(
            topo,
            spec.stage,
            spec.replica,
            dict(spec.weight_sync),
            run_id=spec.run_id,
            config_hash=config_hash,
            secret=secret,
        )
        if weight_sync is not None:
            keep_weight_sync(weight_sync)
            await weight_sync.start()
        for name, rc in cfg.roles.items():
            part = name  # import errors of a backend land here
            roles[name] = create_role(rc.kind_of(name), rc.backend)
        for name, rc in cfg.roles.items():
            part = name
            ctx = _context(spec, topo, roles, name, rc, device)
            ctx.compute = worker.compute  # a concurrent op's compute in the plain ops' thread
            await worker.call(roles[name].setup, ctx)
        for sync in adapter_syncs(topo):  # rollouts fed a LoRA actor's adapters hold them
            for name in (t for t in sync.targets if t in roles):
                part = name
                await worker.call(roles[name].hold_adapters, sync.lora, topo.seed)  # type: ignore[attr-defined]
        for name, role in roles.items():
            # What a role takes from a neighbour set up after it (a reference lent
            # the LoRA actor's base weights: stages/reference.py), once all are up.
            bind = getattr(role, "bind_colocated", None)
            if callable(bind):
                part = name
                await worker.call(bind)
        if spec.resume_dir:
            part = "checkpoint"
            await worker.call(
                checkpoint.load_stage,
                roles,
                Path(spec.resume_dir),
                spec.stage,
                spec.replica,
            )
    except BaseException as exc:  # not only Exception: see failures.interrupted
        if interrupted(exc):
            raise
        raise SetupFailed(part) from exc
    log.info("ready: roles %s on %s", ", ".join(roles), device)
    return device


def _context(
    spec: LaunchSpec,
    topo: Topology,
    roles: dict[str, Role],
    name: str,
    rc: RoleConfig,
    device: torch.device,
) -> StageContext:
    cfg = topo.stages[spec.stage]
    return StageContext(
        stage=spec.stage,
        replica=spec.replica,
        device=device,
        seed=topo.seed,
        run_dir=Path(spec.run_dir),
        options=dict(rc.options),
        colocated=roles,
        world=StageWorld(
            role=name,
            kind=rc.kind_of(name),
            rank=spec.replica,
            world_size=cfg.replicas,
            init_method=spec.init_method,  # "" unless replicas > 1
            init_listen_fd=spec.init_listen_fd,  # its listening socket (rank 0)
            run_id=spec.run_id,
            dataflow=role_ops(topo, name),
        ),
        log=logging.getLogger(f"hybridflow.stage.{name}"),
    )

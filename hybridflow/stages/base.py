"""The seam between the runtime and the roles: what a role implementation must provide.

A stage process hosts one or more *roles* (several when colocated: the hybrid engine puts
actor + rollout + reference in one process on one device). The runtime (pipeline/) owns
sockets, heartbeats and the event loop; a role owns models and compute and never sees a
socket. The runtime calls `Role.handle` in a worker thread, so a role may block on CUDA
or a long `generate` without stalling heartbeats.

Data crosses this seam as a `Batch`: a flat dict of named tensors for one micro-batch,
every tensor with the batch dimension first. Field names are the dataflow's value names
(`prompt_ids  # [B, P]`, `response_ids  # [B, R]`, `rewards  # [B]`, ...).

Invariants:
  - `handle` is only ever called from one thread at a time per stage process, in the
    order the coordinator sent the tasks (roles need no locks);
  - returned tensors are on CPU unless the runtime asked for device tensors;
  - a role raises on bad input; the runtime turns it into a Failure event with the
    traceback. Roles never swallow errors into default values.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from hybridflow.config.imports import load_attr

Batch = dict[str, torch.Tensor]
Metrics = dict[str, float]
Params = dict[str, Any]


@dataclass(frozen=True)
class OpIO:
    """One op of a role as the run's dataflow declares it: the values it reads and writes,
    and its scope ("micro_batch" or "step")."""

    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    scope: str = "micro_batch"


@dataclass(frozen=True)
class StageWorld:
    """Where a role sits in its run (`StageContext.world`), filled in by the stage host."""

    role: str = ""  # the role's name in the topology
    kind: str = ""  # its kind (the name, unless `kind:` says otherwise)
    rank: int = 0  # = the stage's replica
    world_size: int = 1  # = the stage's replicas
    init_method: str = ""  # tcp:// rendezvous of the stage's replicas; "" with one replica
    init_listen_fd: int = -1  # replica 0: the rendezvous's listening socket, inherited
    run_id: str = ""
    dataflow: Mapping[str, OpIO] = field(default_factory=dict)  # this role's ops: op -> OpIO


@dataclass
class StageContext:
    """What a role gets at setup: where it runs and who its colocated neighbours are."""

    stage: str
    replica: int
    device: torch.device
    seed: int
    run_dir: Path
    options: dict[str, Any] = field(default_factory=dict)  # this role's `options:` block
    colocated: dict[str, Role] = field(default_factory=dict)  # role name -> Role, same process
    world: StageWorld = field(default_factory=StageWorld)  # role, ranks, its dataflow ops
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("hybridflow.stage"))
    # `await compute(fn, *args)`: fn(*args) in the stage's worker thread, the one that runs
    # the plain ops (the host sets it; None outside a stage process). Where a concurrent
    # op's heavy part goes when it should not get a thread of its own: on a CPU a second
    # thread's torch ops ran 15-25% slower once the first had used its OpenMP team
    # (bench/RESULTS.md, "CPU GRPO against TRL").
    compute: Callable[..., Awaitable[Any]] | None = None


@runtime_checkable
class Role(Protocol):
    """One role's implementation (a backend). Constructed with no arguments by the registry."""

    def setup(self, ctx: StageContext) -> None:
        """Build models/engines. Called once, in the stage process, before any task."""

    def handle(self, op: str, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """Run `op` on one micro-batch (or on no batch for step-level ops such as
        `optimizer_step` / `reshard`). Returns output tensors and scalar metrics."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (weights, optimizer, RNG); {} if stateless."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Free models/engines. Called once at shutdown, even after errors."""


# Backend registry: (role kind, backend name) -> "module:Class". Role kinds are the
# dataflow's role names (rollout, actor, critic, reference, reward) or "*" for backends
# that can play any role (the synthetic backend).
BACKENDS: dict[tuple[str, str], str] = {}


def register(role_kind: str, backend: str, target: str) -> None:
    BACKENDS[(role_kind, backend)] = target


def backend_names(role_kind: str) -> list[str]:
    return sorted({b for (k, b) in BACKENDS if k in (role_kind, "*")})


def create_role(role_kind: str, backend: str) -> Role:
    """Instantiate the registered backend. Unknown names raise KeyError (config validation
    reports them with the dotted key before any process starts)."""
    instance: Role = backend_class(role_kind, backend)()
    return instance


def backend_class(role_kind: str, backend: str) -> type[Any]:
    """The registered backend's class, imported, not constructed (what the runtime asks
    about a role: its ops and capabilities, stages/contract.py). Unknown: KeyError."""
    target = BACKENDS.get((role_kind, backend)) or BACKENDS.get(("*", backend))
    if target is None:
        raise KeyError(
            f"no backend {backend!r} for role {role_kind!r}; known: {backend_names(role_kind)}"
        )
    cls: type[Any] = load_attr(target, f"{role_kind}.backend")
    return cls

"""Placement: per-role `device_mapping`s -> the Topology's stages (processes and devices).

Accepted mapping forms (per role):
    "cpu"                          one process on the CPU
    "cpu:N"                        one process on the CPU, in CPU slot N: roles on
                                   different slots get different processes
    "cuda:N"                       one process on GPU N
    ["cuda:0", "cuda:1"]           data-parallel ranks: one replica per device
    [("node0", "cuda:0"), ...]     devices on named hosts (needs a multi-host launcher;
                                   "localhost" and this host's name mean this host)

Rules (the hybrid engine / disaggregation split of HybridFlow):
  - roles whose mappings are identical share one stage: one process per replica hosts
    all of them (actor + rollout + reference switch phases on the same GPUs);
  - roles whose mappings are disjoint get separate stages;
  - mappings that overlap without being identical are an error (a GPU would be shared by
    two process groups that do not know about each other); the CPU is the exception:
    any number of processes may use it;
  - a GPU that does not exist here, a device listed twice, a node name without a
    multi-host launcher: errors, raised at `build()` before any process starts (GPUs of
    other hosts are that launcher's to check).

Consumes plain mapping values; produces `StagePlacement`s (roles, replicas, devices)
that the builder turns into `stages:` of a Topology. Imports no torch (the caller passes
the number of CUDA devices it sees).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.config.schema import is_local_host
from hybridflow.errors import ConfigError

# Canonical role order: the stage hosting several roles is named after the first.
ROLE_ORDER = ("actor", "rollout", "reference", "critic", "reward")
_DEVICE = re.compile(r"^(cpu(:\d+)?|cuda:\d+)$")


@dataclass(frozen=True)
class Slot:
    node: str  # "" = this host
    device: str  # "cpu" | "cpu:N" | "cuda:N" (as written; "cpu:N" runs on "cpu")

    @property
    def runtime_device(self) -> str:
        return "cpu" if self.device.startswith("cpu") else self.device

    @property
    def exclusive(self) -> bool:
        return self.device.startswith("cuda")

    def __str__(self) -> str:
        return f"{self.node}:{self.device}" if self.node else self.device


DeviceMap = tuple[Slot, ...]


@dataclass(frozen=True)
class StagePlacement:
    name: str
    roles: tuple[str, ...]
    slots: DeviceMap

    @property
    def replicas(self) -> int:
        return len(self.slots)

    @property
    def devices(self) -> str | list[str]:
        devs = [s.runtime_device for s in self.slots]
        return devs[0] if len(set(devs)) == 1 else devs


def normalize(role: str, mapping: Any) -> DeviceMap:
    """One role's mapping value -> slots. ConfigError at `device_mapping.<role>`."""
    path = f"device_mapping.{role}"
    if isinstance(mapping, str):
        return (_slot(path, "", mapping),)
    if isinstance(mapping, Sequence) and not isinstance(mapping, (str, bytes)):
        if not mapping:
            raise ConfigError(path, "is an empty list; give at least one device")
        slots = []
        for i, item in enumerate(mapping):
            sub = f"{path}[{i}]"
            if isinstance(item, str):
                slots.append(_slot(sub, "", item))
            elif (
                isinstance(item, Sequence)
                and len(item) == 2
                and all(isinstance(x, str) for x in item)
            ):
                slots.append(_slot(sub, item[0], item[1]))
            else:
                raise ConfigError(
                    sub, f"expected a device string or a (node, device) pair, got {item!r}"
                )
        seen: dict[Slot, int] = {}
        for i, s in enumerate(slots):
            if s.exclusive and s in seen:
                raise ConfigError(
                    f"{path}[{i}]", f"{s} is listed twice (also at [{seen[s]}]); one rank per GPU"
                )
            seen.setdefault(s, i)
        return tuple(slots)
    raise ConfigError(
        path,
        f"expected 'cpu', 'cuda:N', a list of them or of (node, device) pairs; got {mapping!r}",
    )


def _slot(path: str, node: str, device: str) -> Slot:
    dev = device.strip()
    if dev == "cuda":
        dev = "cuda:0"
    if not _DEVICE.match(dev):
        raise ConfigError(path, f"{device!r} is not a device; use 'cpu', 'cpu:N' or 'cuda:N'")
    node = node.strip()
    return Slot("" if is_local_host(node) else node, dev)


def place(
    mappings: Mapping[str, DeviceMap],
    *,
    cuda_count: int,
    multi_host: bool = False,
) -> list[StagePlacement]:
    """Group roles into stages (see the module docstring). `mappings` is role -> slots."""
    for role, slots in mappings.items():
        for i, s in enumerate(slots):
            sub = f"device_mapping.{role}" + (f"[{i}]" if len(slots) > 1 else "")
            if s.node and not multi_host:
                raise ConfigError(
                    sub,
                    f"node {s.node!r}: placing roles on other hosts needs a multi-host "
                    "launcher, and none is configured; drop the node name to run here",
                )
            if s.exclusive and not s.node and int(s.device.split(":")[1]) >= cuda_count:
                raise ConfigError(
                    sub,
                    f"{s.device} is not available: this machine has {cuda_count} CUDA "
                    "device(s); use 'cpu' (or fewer GPUs)",
                )
    groups: dict[DeviceMap, list[str]] = {}
    for role in _ordered(mappings):
        groups.setdefault(mappings[role], []).append(role)
    items = list(groups.items())
    for i, (a, roles_a) in enumerate(items):
        for b, roles_b in items[i + 1 :]:
            shared = sorted({str(s) for s in a if s.exclusive} & {str(s) for s in b if s.exclusive})
            if shared:
                raise ConfigError(
                    f"device_mapping.{roles_b[0]}",
                    f"{_show(roles_b)} on {_fmt(b)} and {_show(roles_a)} on {_fmt(a)} share "
                    f"{', '.join(shared)} without being identical; map both to the same "
                    "devices (colocated, one process) or to disjoint ones (separate processes)",
                )
    out = []
    names: set[str] = set()
    for slots, roles in items:
        name = roles[0]
        while name in names:
            name += "_"
        names.add(name)
        out.append(StagePlacement(name, tuple(roles), slots))
    return out


def _ordered(mappings: Mapping[str, Any]) -> list[str]:
    known = [r for r in ROLE_ORDER if r in mappings]
    return known + sorted(r for r in mappings if r not in ROLE_ORDER)


def _show(roles: list[str]) -> str:
    return roles[0] if len(roles) == 1 else "+".join(roles)


def _fmt(slots: DeviceMap) -> str:
    return str(slots[0]) if len(slots) == 1 else "[" + ", ".join(map(str, slots)) + "]"

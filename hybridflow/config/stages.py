"""The `stages:` section: OS processes (times `replicas`), each hosting one or more roles
(several = colocated, sharing a device: the hybrid engine), and where they run.

Invariant: a stage's roles have valid names (never `driver`, which names the
coordinator's ops), its devices are `cpu` / `cuda:N`, and a list of devices or hosts
has one entry per replica.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from hybridflow.config.checks import DEVICE, HOST, IDENT, at_least, join, require
from hybridflow.errors import ConfigError

DRIVER_ROLE = "driver"  # ops computed in the coordinator process, not in a stage

# THE role table: the kinds of the built-in roles (RoleConfig.kind; a role named after its
# kind needs none), each with every name a user may write for it, the preferred one first.
# The Python API's device_mapping keys and the step logic's role names (`ref.get_logprob`)
# are these names; the rollout is reached in the logic through `actor.generate`.
ROLE_NAMES: dict[str, tuple[str, ...]] = {
    "rollout": ("rollout",),
    "actor": ("actor",),
    "critic": ("critic",),
    "reference": ("ref", "reference"),
    "reward": ("reward", "rm"),
}
ROLE_KINDS = tuple(ROLE_NAMES)


def role_kind(name: str) -> str:
    """The role kind a name stands for (`ref` -> `reference`); any other name as given."""
    return next((kind for kind, names in ROLE_NAMES.items() if name in names), name)


@dataclass(frozen=True)
class RoleConfig:
    """One role hosted by a stage. `kind` picks the implementation family (defaults to the
    role's name: one of ROLE_KINDS, rollout, actor, critic, reference, reward); `backend`
    picks the implementation; `options` go to it verbatim (StageContext.options)."""

    backend: str  # the implementation: hf, native, vllm, function, model, http, zmq, ...
    kind: str = ""  # "" = the role's name (rollout, actor, critic, reference, reward)
    options: dict[str, Any] = field(default_factory=dict)  # the backend's options

    def kind_of(self, name: str) -> str:
        """The kind of this role when a stage hosts it as `name`: `kind`, else the name."""
        return self.kind or name


@dataclass(frozen=True)
class StageConfig:
    """One stage = `replicas` identical OS processes, each hosting every role listed.
    `devices`: one device for all replicas, or a list with one device per replica.
    `hosts`: where they run, like `devices` (one for all, or one per replica): "" or this
    host's name = here; another name = a node of a multi-host launcher (`hybridflow run
    --launcher ray`: the node started with the resource `hybridflow_host:<name>`, or an
    IP), which then also owns the check that the devices exist there."""

    roles: dict[str, RoleConfig]  # role name -> its backend; several = colocated
    replicas: int = 1  # processes; a trainable role's replicas are FSDP ranks of one model
    devices: str | list[str] = "cpu"  # "cpu" or "cuda:N", for all replicas or one per replica
    hosts: str | list[str] = ""  # "" = this host; or a node name, for all or one per replica

    def device_of(self, replica: int) -> str:
        return self.devices if isinstance(self.devices, str) else self.devices[replica]

    def host_of(self, replica: int) -> str:
        """The replica's host; "" for this one (its own names included)."""
        host = self.hosts if isinstance(self.hosts, str) else self.hosts[replica]
        return "" if is_local_host(host) else host

    def validate(self, path: str) -> None:
        at_least(self.replicas, 1, join(path, "replicas"))
        require(bool(self.roles), join(path, "roles"), "must host at least one role")
        for name in self.roles:
            require(
                bool(IDENT.match(name)) and name != DRIVER_ROLE,
                join(path, f"roles.{name}"),
                f"{name!r} is not a valid role name"
                + (
                    f" ({DRIVER_ROLE!r} is reserved for coordinator ops)"
                    if name == DRIVER_ROLE
                    else ""
                ),
            )
        devices = [self.devices] if isinstance(self.devices, str) else self.devices
        for i, dev in enumerate(devices):
            sub = join(path, "devices") + ("" if isinstance(self.devices, str) else f"[{i}]")
            require(bool(DEVICE.match(dev)), sub, f"{dev!r} is not a device; use 'cpu' or 'cuda:N'")
        if isinstance(self.devices, list) and len(self.devices) != self.replicas:
            raise ConfigError(
                join(path, "devices"),
                f"lists {len(self.devices)} device(s) for {self.replicas} replica(s); "
                "give one device per replica or a single device string",
            )
        hosts = [self.hosts] if isinstance(self.hosts, str) else self.hosts
        for i, host in enumerate(hosts):
            sub = join(path, "hosts") + ("" if isinstance(self.hosts, str) else f"[{i}]")
            require(
                bool(HOST.match(host)),
                sub,
                f"{host!r} is not a host name (letters, digits, '.', '-', '_', ':')",
            )
        if isinstance(self.hosts, list) and len(self.hosts) != self.replicas:
            raise ConfigError(
                join(path, "hosts"),
                f"lists {len(self.hosts)} host(s) for {self.replicas} replica(s); "
                "give one host per replica or a single host name",
            )


def is_local_host(name: str) -> bool:
    """Whether a stage's `hosts` entry means this machine."""
    return name in ("", "local", "localhost", "127.0.0.1", socket.gethostname())

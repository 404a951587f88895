"""What a session launches: one `ProcessSpec` per stage replica, where, and its sockets.

    stage_specs(plan, ...)    one spec per stage replica: the entry point (STAGE_ENTRY),
                              its payload (topology, stage, replica, the coordinator's
                              endpoint, run id and run_dir, the rendezvous of its stage's
                              ranks, its weight-link endpoints, the checkpoint to resume,
                              the run's secret and its CurveZMQ keys) and the listening
                              sockets it inherits (pass_fds)
    place_on_hosts(plan, l)   the plan's process -> host map to a multi-host launcher
    ipc_dir(topo, run_id)     the directory of the run's ipc:// sockets

The payload travels over the launcher's stdin pipe, never argv, env or a file: it holds
the secret. Listening sockets (a stage's rendezvous, a weight link's) are bound here and
inherited by the process that serves them, so no other process can take the port in
between (no bind-close-rebind). The stage process decodes the payload
(pipeline/host/stage_process.py).

Invariant: an ipc directory carries its owner's pid in its name (`hf-<run>-p<pid>-*`);
a coordinator killed with SIGKILL cannot remove its own, and the next session's
`sweep_stale_ipc_dirs` does once that pid is gone, never one of a live process.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any

from hybridflow.config.loader import to_dict
from hybridflow.config.schema import Topology
from hybridflow.errors import ConfigError
from hybridflow.pipeline.host.weight_sync import endpoints
from hybridflow.pipeline.plan.planner import Plan
from hybridflow.pipeline.runtime.launcher import LAUNCHER_RENDEZVOUS, ProcessSpec
from hybridflow.transport import curve
from hybridflow.transport.liveness import pid_alive

log = logging.getLogger("hybridflow.session")

STAGE_ENTRY = "hybridflow.pipeline.host.stage_process:main"


def stage_specs(
    plan: Plan,
    run_id: str,
    endpoint: str,
    resume_dir: str | None = None,
    *,
    run_dir: Path,
    secret: bytes,
    listeners: list[socket.socket],
    curve_keys: curve.RunKeys | None = None,
    bind_rendezvous: bool = True,
) -> list[ProcessSpec]:
    """One spec per stage replica (the module docstring). Listening sockets for the
    rendezvous and the weight links are appended to `listeners`: close them once the
    processes started (they inherited theirs)."""
    topo_data = to_dict(plan.topology)
    host = plan.topology.transport.host
    # Replicas of one stage are ranks of one group (FSDP): give them a rendezvous address
    # so roles never pick ports themselves. Its socket is bound here and kept listening;
    # replica 0 inherits it and its TCPStore adopts it (`init_listen_fd`), so no other
    # process can take the port in between (no bind-close-rebind).
    # A multi-host launcher binds it on rank 0's node instead (`bind_rendezvous=False`).
    init: dict[str, tuple[str, int]] = {}
    for stage, n in plan.replicas.items():
        if n > 1 and not bind_rendezvous:
            init[stage] = (LAUNCHER_RENDEZVOUS, -1)
        elif n > 1:
            sock = socket.create_server((host, 0), backlog=128)
            listeners.append(sock)
            init[stage] = (f"tcp://{host}:{sock.getsockname()[1]}", sock.fileno())
    # Stage-to-stage weight links (disaggregated reshard): one endpoint per sending role.
    weight_sync = endpoints(plan.topology, endpoint, listeners)
    specs = []
    for p in plan.processes:
        links: dict[str, dict[str, Any]] = {}
        fds: list[int] = []
        for source, spec in weight_sync.items():
            mine = spec["stage"] == p.stage and p.replica == 0  # the sending replica
            links[source] = {k: v for k, v in spec.items() if mine or not k.endswith("_fd")}
            fds += [v for k, v in spec.items() if mine and k.endswith("_fd")]
        init_method, init_fd = init.get(p.stage, ("", -1))
        if p.replica == 0 and init_fd >= 0:
            fds.append(init_fd)
        payload = {
            "topology": copy.deepcopy(topo_data),  # each its own: launchers may edit
            "stage": p.stage,
            "replica": p.replica,
            "endpoint": endpoint,
            "run_id": run_id,
            "run_dir": str(run_dir),
            "parent_pid": os.getpid(),
            "init_method": init_method,
            "init_listen_fd": init_fd if p.replica == 0 else -1,
            "resume_dir": resume_dir or "",
            "weight_sync": links,
            "secret": secret.hex(),
        }
        if curve_keys is not None:  # the child's bootstrap installs and removes them
            payload["curve"] = curve_keys.for_process(p.name).to_payload()
        specs.append(
            ProcessSpec(
                name=p.name,
                target=STAGE_ENTRY,
                payload=payload,
                title=f"hf-{p.stage}-{p.replica}",
                pass_fds=tuple(fds),
            )
        )
    return specs


def places_hosts(launcher: object) -> bool:
    """Whether `launcher` puts processes on named hosts (a multi-host launcher)."""
    return callable(getattr(launcher, "assign_nodes", None))


def place_on_hosts(plan: Plan, launcher: object) -> None:
    """Hand the plan's process -> host map (`stages.<s>.hosts`) to a multi-host launcher;
    a host name with a launcher that only starts local processes is a ConfigError."""
    nodes = plan.nodes()
    if places_hosts(launcher):
        launcher.assign_nodes(nodes)  # type: ignore[attr-defined]
        return
    if nodes:
        name, host = next(iter(nodes.items()))
        raise ConfigError(
            f"stages.{name.split('/')[0]}.hosts",
            f"puts {name} on host {host!r}: processes on other hosts need a multi-host "
            "launcher (hybridflow run --launcher ray); drop the host to run here",
        )


def ipc_dir(topo: Topology, run_id: str) -> str | None:
    """A fresh directory for the run's ipc:// sockets (None unless transport.protocol is
    ipc), under transport.ipc_dir or the temp dir; stale ones are swept first."""
    if topo.transport.protocol != "ipc":
        return None
    base = topo.transport.ipc_dir or None
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
    sweep_stale_ipc_dirs(base)
    # The owner's pid is in the name: a coordinator killed with SIGKILL cannot remove its
    # directory, the next session (here) does once that pid is gone.
    return tempfile.mkdtemp(prefix=f"hf-{run_id[:8]}-p{os.getpid()}-", dir=base)


_IPC_DIR_NAME = re.compile(r"^hf-[0-9A-Za-z_]{1,8}-p(\d+)-[0-9A-Za-z_]+$")


def sweep_stale_ipc_dirs(base: str | None = None) -> list[str]:
    """Remove the ipc directories (`hf-<run>-p<pid>-*`, ours only) whose coordinator pid is
    no longer running; never one of a live process. -> the paths removed."""
    base = base or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = os.listdir(base)
    except OSError:
        return removed
    for entry in entries:
        m = _IPC_DIR_NAME.match(entry)
        if m is None or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(base, entry)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.info("removed stale ipc directory %s (pid %s is gone)", path, m.group(1))
    return removed

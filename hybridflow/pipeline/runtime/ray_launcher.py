"""The Ray launcher: stage processes on the nodes of a Ray cluster, one supervising actor each.

    driver (coordinator)                        node of the process's host
      RayLauncher.start(specs)                    _Supervisor actor (one per process)
        actor placed by resource                    LocalLauncher.start([spec]): the same
        `hybridflow_host:<name>` (or `node:<ip>`)   `python -P -m ...launcher NAME RUN_ID`
        + num_gpus for a cuda slot                  child, header on stdin, PDEATHSIG to
        .wait() ref per process  <--------------    this actor; .wait() returns its exit
      poll(): ready wait refs -> ProcessExit (a dead actor or node: exit -9 with the reason)
      stop(t): actor.stop(t) (wait, TERM, KILL, reap on the node) -> ray.kill every actor

So a stage process runs exactly the code it runs under the LocalLauncher; the coordinator
stays on the driver and learns nothing of Ray. Host names come from `assign_nodes` (the
builder's `device_mapping` pairs); a name that is an IP address means Ray's own
`node:<ip>` resource, any other name the custom resource `hybridflow_host:<name>` that
the node was started with (`ray start --resources '{"hybridflow_host:node1": 1000}'`).
Processes without a host go wherever Ray puts them.

Invariants: `ray` is imported only when this launcher is used; the payload (with the run
secret and Curve keys) goes to the actor as a method argument over Ray's RPC, never argv,
the environment or a file (Ray's RPC is only encrypted with Ray TLS: see README); a child
never outlives its actor (PDEATHSIG) and `stop()` kills every actor, so nothing of the run
is left on any node; a process whose actor or node died is reported by `poll()` as an
exit with the host, which the coordinator turns into a StageDeadError. Replicated stages
(the ranks of one FSDP model, on one node or several) meet at a TCPStore that rank 0
serves on its own node: its supervisor binds the socket before any rank starts
(`_rendezvous`), so the session binds nothing for them. Not supported (refused at start):
ipc endpoints and stage-to-stage weight links (their TCP listeners are bound on the
driver's host and inherited by the sending process).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hybridflow.errors import PipelineError
from hybridflow.pipeline.runtime.launcher import (
    LAUNCHER_RENDEZVOUS,
    LocalLauncher,
    ProcessExit,
    ProcessSpec,
)

log = logging.getLogger(__name__)

RESOURCE_PREFIX = "hybridflow_host:"
# Tensors between hosts cannot go through /dev/shm: send every CPU tensor as frames.
NO_SHM = 1 << 62


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise PipelineError(
            "the ray launcher needs Ray: pip install 'hybridflow[ray]' (or ray) on every node"
        ) from exc
    return ray


def node_resource(host: str) -> str:
    """The Ray resource a process on `host` asks for."""
    try:
        ipaddress.ip_address(host)
        return f"node:{host}"
    except ValueError:
        return RESOURCE_PREFIX + host


class _Supervisor:
    """Runs on the node (a Ray actor): one stage process, started by a LocalLauncher."""

    def __init__(self) -> None:
        self.launcher = LocalLauncher()
        self.stopped: int | None = None
        self.listener: socket.socket | None = None  # rank 0 of a replicated stage

    def bind(self) -> tuple[str, int]:
        """Bind the stage's rendezvous on this node (rank 0's supervisor); -> (ip, port)."""
        import ray

        ip = ray.util.get_node_ip_address()
        self.listener = socket.create_server((ip, 0), backlog=128)
        return ip, int(self.listener.getsockname()[1])

    def start(self, spec: ProcessSpec, cwd: str) -> dict[str, Any]:
        import ray

        with contextlib.suppress(OSError):  # the driver's directory, if the node has it
            os.chdir(cwd)
        # cuda:N in the topology is GPU N of this node; Ray's own mask would renumber it.
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        # The stage watches its parent: this actor, not the coordinator on another host.
        payload = {**spec.payload, "parent_pid": os.getpid()}
        fds = spec.pass_fds
        if self.listener is not None:  # the child's TCPStore adopts it (init_listen_fd)
            payload["init_listen_fd"] = self.listener.fileno()
            fds = (*fds, self.listener.fileno())
        spec = replace(spec, payload=payload, pass_fds=fds)
        try:
            self.launcher.start([spec])
        finally:
            if self.listener is not None:  # the child holds its own copy now
                self.listener.close()
                self.listener = None
        return {
            "pid": self.launcher.pids()[spec.name],
            "host": socket.gethostname(),
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    def wait(self) -> int | None:
        while True:
            exits = self.launcher.poll()
            if exits:
                return exits[0].exitcode
            if not self.launcher.pids():  # stopped (and reaped) by stop()
                return self.stopped
            time.sleep(0.1)

    def stop(self, timeout: float) -> int | None:
        exits = self.launcher.stop(timeout)
        self.stopped = exits[0].exitcode if exits else None
        return self.stopped


@dataclass
class _Proc:
    actor: Any
    done: Any  # ObjectRef of actor.wait()
    pid: int
    host: str
    node_id: str
    exit: ProcessExit | None = None


class RayLauncher:
    """One Ray actor per stage process; the Launcher protocol of launcher.py."""

    def __init__(
        self,
        address: str | None = None,
        *,
        bind_host: str | None = None,
        num_cpus: float = 0.0,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.address = address
        self.bind_host = bind_host
        self.num_cpus = num_cpus
        self.start_timeout_s = start_timeout_s
        self._nodes: dict[str, str] = {}
        self._procs: dict[str, _Proc] = {}

    # -- what the builder asks ---------------------------------------------------------
    def assign_nodes(self, nodes: Mapping[str, str]) -> None:
        """Process name ("engine/0") -> host name or IP (from `device_mapping` pairs)."""
        self._nodes = dict(nodes)

    def transport_settings(self) -> dict[str, Any]:
        """The `transport:` section a run on this launcher needs: TCP on the driver's
        address (Curve when that is not loopback), tensors as frames (no shared memory
        between hosts)."""
        host = self.bind_host or _ray().util.get_node_ip_address()
        return {"protocol": "tcp", "host": host, "shm_threshold": NO_SHM}

    # -- Launcher ----------------------------------------------------------------------
    def start(self, specs: Sequence[ProcessSpec]) -> None:
        ray = _ray()
        if not ray.is_initialized():
            ray.init(address=self.address, log_to_driver=True)
        for spec in specs:
            _check(spec)
        remote = ray.remote(_Supervisor)
        actors: dict[str, tuple[Any, str | None, dict[str, Any]]] = {}
        for spec in specs:
            if spec.name in self._procs or spec.name in actors:
                raise ValueError(f"process {spec.name!r} started twice")
            opts: dict[str, Any] = {
                "num_cpus": self.num_cpus,
                "num_gpus": 1 if _device(spec).startswith("cuda") else 0,
                "max_concurrency": 4,  # wait() blocks one thread; stop() needs another
                "max_restarts": 0,
            }
            node = self._nodes.get(spec.name)
            if node:
                opts["resources"] = {node_resource(node): 0.001}
            actors[spec.name] = (remote.options(**opts).remote(), node, opts)
        try:
            specs = self._rendezvous(ray, specs, actors)
        except Exception:
            for a, *_ in actors.values():
                ray.kill(a, no_restart=True)
            raise
        pending = {}
        for spec in specs:
            actor, node, opts = actors[spec.name]
            spec = replace(spec, payload={**spec.payload, "endpoint": self._endpoint(spec)})
            pending[spec.name] = (actor, actor.start.remote(spec, os.getcwd()), node, opts)
        for name, (actor, ref, node, opts) in pending.items():
            try:
                info = ray.get(ref, timeout=self.start_timeout_s)
            except Exception as exc:
                for a, *_ in pending.values():
                    ray.kill(a, no_restart=True)
                if isinstance(exc, ray.exceptions.GetTimeoutError):
                    raise PipelineError(
                        f"process {name}: no Ray node took it within {self.start_timeout_s:.0f}s "
                        f"(it asks for {opts.get('resources') or 'any node'}, "
                        f"{opts['num_gpus']} GPU); start a node with that resource "
                        f"(host {node!r}: ray start --resources "
                        f"'{{\"{node_resource(node or 'NAME')}\": 1000}}')"
                    ) from None
                raise PipelineError(f"process {name}: its Ray actor failed: {exc}") from exc
            self._procs[name] = _Proc(
                actor, actor.wait.remote(), int(info["pid"]), str(info["ip"]), info["node_id"]
            )
            log.debug("started %s pid %d on %s", name, info["pid"], info["ip"])

    def _rendezvous(
        self, ray: Any, specs: Sequence[ProcessSpec], actors: Mapping[str, tuple[Any, ...]]
    ) -> list[ProcessSpec]:
        """Replicated stages (FSDP ranks) meet at a TCPStore served by rank 0 on its node:
        rank 0's supervisor binds the listening socket there and keeps it until its child
        inherits it (no bind-close-rebind window, as on one host); every rank of the stage
        gets that address as its `init_method`."""
        addr: dict[str, str] = {}
        for spec in specs:
            p = spec.payload
            if p.get("init_method") == LAUNCHER_RENDEZVOUS and int(p.get("replica", 0)) == 0:
                actor = actors[spec.name][0]
                try:
                    ip, port = ray.get(actor.bind.remote(), timeout=self.start_timeout_s)
                except ray.exceptions.GetTimeoutError:
                    raise PipelineError(
                        f"process {spec.name}: no Ray node took it within "
                        f"{self.start_timeout_s:.0f}s to bind its stage's rendezvous"
                    ) from None
                addr[str(p["stage"])] = f"tcp://{ip}:{port}"
        out = []
        for spec in specs:
            p = spec.payload
            if p.get("init_method") == LAUNCHER_RENDEZVOUS:
                spec = replace(spec, payload={**p, "init_method": addr[str(p["stage"])]})
            out.append(spec)
        return out

    def pids(self) -> dict[str, int]:
        """Process name -> pid on its node."""
        return {name: p.pid for name, p in self._procs.items()}

    def hosts(self) -> dict[str, str]:
        """Process name -> the IP of the node it runs on."""
        return {name: p.host for name, p in self._procs.items()}

    def poll(self) -> list[ProcessExit]:
        ray = _ray()
        waiting = {p.done: (n, p) for n, p in self._procs.items() if p.exit is None}
        if waiting:
            ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
            for ref in ready:
                name, p = waiting[ref]
                p.exit = self._exit_of(ray, name, p, ref)
        return [p.exit for p in self._procs.values() if p.exit is not None]

    def stop(self, timeout: float) -> list[ProcessExit]:
        ray = _ray()
        procs = list(self._procs.items())
        stops = {p.actor.stop.remote(timeout): (n, p) for n, p in procs if p.exit is None}
        if stops:  # each actor escalates wait -> TERM -> KILL and reaps on its node
            ready, _ = ray.wait(list(stops), num_returns=len(stops), timeout=timeout + 10.0)
            for ref in ready:
                name, p = stops[ref]
                p.exit = self._exit_of(ray, name, p, ref)
        for _, p in procs:
            ray.kill(p.actor, no_restart=True)  # its child, if any is left, dies with it
        refs = [p.done for _, p in procs]
        if refs:  # the actors are gone once their wait() refs resolve
            ray.wait(refs, num_returns=len(refs), timeout=10.0)
        out = []
        for name, p in procs:
            if p.exit is None:
                p.exit = self._exit_of(ray, name, p, p.done)
            out.append(p.exit)
        self._procs.clear()
        return out

    # ------------------------------------------------------------------------------
    def _endpoint(self, spec: ProcessSpec) -> str:
        """The coordinator's address as the nodes reach it (a wildcard bind -> our IP)."""
        endpoint = str(spec.payload.get("endpoint", ""))
        for wildcard in ("tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"):
            if endpoint.startswith(wildcard):
                ip = _ray().util.get_node_ip_address()
                return f"tcp://{ip}:{endpoint[len(wildcard) :]}"
        return endpoint

    @staticmethod
    def _exit_of(ray: Any, name: str, p: _Proc, ref: Any) -> ProcessExit:
        try:
            code = ray.get(ref, timeout=0)
        except ray.exceptions.GetTimeoutError:
            return ProcessExit(name, p.pid, None, host=p.host)
        except ray.exceptions.RayError as exc:  # the actor, its worker or its node died
            why = type(exc).__name__
            return ProcessExit(
                name, p.pid, -9, host=p.host, reason=f"was lost with its Ray actor ({why})"
            )
        return ProcessExit(name, p.pid, code, host=p.host)


def _device(spec: ProcessSpec) -> str:
    stage = spec.payload.get("topology", {}).get("stages", {}).get(spec.payload.get("stage"), {})
    devices = stage.get("devices", "cpu")
    if isinstance(devices, list):
        return str(devices[int(spec.payload.get("replica", 0))])
    return str(devices)


def _check(spec: ProcessSpec) -> None:
    if str(spec.payload.get("endpoint", "")).startswith("ipc://"):
        raise PipelineError(
            f"process {spec.name}: the ray launcher needs transport.protocol: tcp "
            "(ipc sockets stay on one host); --set transport.protocol=tcp"
        )
    if spec.pass_fds or spec.payload.get("init_method", "") not in ("", LAUNCHER_RENDEZVOUS):
        raise PipelineError(
            f"process {spec.name}: the ray launcher does not support stage-to-stage weight "
            "links yet (their listening sockets are set up on the driver's host); use the "
            "hybrid engine (the rollout in the actor's stage)"
        )

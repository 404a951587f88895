"""Disaggregated weight sync: the actor's `reshard` streams its weights, bucket by bucket,
straight to rollout stages in other processes, whose `load_weights` loads each bucket.

When (derived from the topology, no setting): a step op `R.load_weights` with **no
inputs**, hosted by another stage than a step op `A.reshard`. Then A's replica 0 sends to
every replica of R's stage. (`reshard` with the rollout role in A's own process stays the
in-process hand-off of stages/actor.py; `load_weights` with inputs stays a plain op fed by
the coordinator.) The two ops of a link do not wait for each other in the step barrier
(`sync_partners`): they run together and each waits for everything listed before it, so
with max_offpolicy_steps = 0 the next rollout starts only after the last bucket landed,
and with k > 0 the rollout keeps generating on the old weights until its `load_weights`
task (queued behind those generates, in order) has loaded the new ones.

How (weight_stream.py): the sending replica binds a ROUTER at the endpoint the runner
allocated (`endpoints`, one per sending role, handed to every stage in its payload);
each receiving replica connects a DEALER (identity `<role>@<stage>/<replica>`). Buckets
go as `Weights(version, bucket, last)` messages with the tensors beside them (pooled
shared memory on CPU, the NCCL tier when both ends are on CUDA), each acknowledged once
loaded, at most WINDOW unacknowledged per receiver.

Invariants:
  - host memory in flight is bounded by buckets, never the whole model: a bucket holds
    whole parameters up to the actor's `weight_bucket_mb`, the sender holds the next one
    as views (no copy), and at most WINDOW buckets per receiver are sent and unacked;
  - buckets of one version arrive in order 0..n-1 and end with `last`; anything else is a
    `PipelineError` naming link, bucket and version, never a silent partial load;
  - every wait is bounded by the op's `sync_timeout_s` param (default DEFAULT_TIMEOUT_S),
    and a receiver process that dies mid-sync ends the sender's wait at once
    (`PeerDeadError` naming it, the version and the bucket);
  - roles never see a socket: the stage host (tasks.py) calls this module, which
    calls the sender's `weight_buckets()` and the receiver's `load_weights` op.
"""

from __future__ import annotations

import enum
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol, cast

from hybridflow.config.schema import Topology
from hybridflow.errors import BatchError, PipelineError
from hybridflow.pipeline.host.weight_stream import (
    DEFAULT_TIMEOUT_S,
    WINDOW,
    Bucket,
    Metrics,
    WeightReceiver,
    WeightSender,
)
from hybridflow.pipeline.plan.weight_links import (
    WeightLink,
    identity,
    links,
)
from hybridflow.transport.protocol import Task

__all__ = ["DEFAULT_TIMEOUT_S", "WINDOW", "StageWeightSync", "Via", "WeightLink", "links"]

TIMEOUT_PARAM = "sync_timeout_s"  # op param bounding every wait of one sync
# load_weights param: take the buckets into private memory as they arrive, while the
# rollout still generates, and load them at the barrier (see `stage`/`apply`).
STAGE_PARAM = "stage_weights"
Staged = list[tuple[Bucket, bool, int]]  # (bucket, last, version) in arrival order


# ---------------------------------------------------------------------------------------
# What the topology implies


def endpoints(
    topo: Topology, coordinator_endpoint: str, listeners: list[socket.socket]
) -> dict[str, dict[str, Any]]:
    """Allocate each link's endpoint (and NCCL rendezvous port): source role -> plain data
    that the runner puts into every stage's payload. ipc runs use the run's ipc directory.

    A TCP port is never picked by bind-close-rebind (another process could take it in
    between): each is a socket bound to port 0 and left listening, appended to
    `listeners`; its fd (`listen_fd`, `nccl_listen_fd`) goes to the sending process
    (`stage`, replica 0), which adopts it (ZMQ_USE_FD / TCPStore's master_listen_fd). The
    caller closes `listeners` once that process has started."""
    out: dict[str, dict[str, Any]] = {}
    host = topo.transport.host
    for link in links(topo):
        spec: dict[str, Any] = {"stage": link.source_stage, "nccl_port": 0}
        if coordinator_endpoint.startswith("ipc://"):
            base = coordinator_endpoint[len("ipc://") :].rsplit("/", 1)[0]
            spec["endpoint"] = f"ipc://{base}/weights-{link.source}"
        else:
            sock = _listener(host, listeners)
            spec["endpoint"] = f"tcp://{host}:{sock.getsockname()[1]}"
            spec["listen_fd"] = sock.fileno()
        if link.tier == "nccl":
            sock = _listener(host, listeners)
            spec["nccl_port"], spec["nccl_listen_fd"] = sock.getsockname()[1], sock.fileno()
        out[link.source] = spec
    return out


def _listener(host: str, listeners: list[socket.socket]) -> socket.socket:
    sock = socket.create_server((host, 0), backlog=128)
    listeners.append(sock)
    return sock


# ---------------------------------------------------------------------------------------
# The stage runtime's side


class WeightSource(Protocol):
    """What a sending role offers (stages/actor.py `Actor`)."""

    version: int

    def weight_buckets(self, bucket_bytes: int | None = None) -> Iterator[Bucket]: ...


InWorker = Callable[..., Awaitable[Any]]


class Via(enum.Enum):
    """How the stage host runs one linked op, instead of calling the role (`routes`)."""

    SEND = "send"  # the source's reshard: stream the weights to the link's receivers
    RECEIVE = "receive"  # a target's load_weights, as a barrier: pull and load each bucket
    STAGE = "stage"  # a target's load_weights with `stage_weights`: receive now, load at
    # the barrier (`stage` / `apply`)


class StageWeightSync:
    """The weight-sync ends hosted by one stage replica. `routes` says which ops of this
    replica's roles are ends of a link, from the plan's links (their dataflow indices),
    never from op names: the stage host runs those here instead of calling the role."""

    def __init__(self) -> None:
        self.senders: dict[str, tuple[WeightLink, WeightSender | None]] = {}  # source role
        self.receivers: dict[str, tuple[WeightLink, WeightReceiver]] = {}  # target role
        self.routes: dict[tuple[str, str], Via] = {}  # (role, op) -> how the host runs it

    @classmethod
    def for_stage(
        cls,
        topo: Topology,
        stage: str,
        replica: int,
        allocated: dict[str, dict[str, Any]],
        *,
        run_id: str,
        config_hash: str,
        secret: bytes,
    ) -> StageWeightSync | None:
        found = [
            link
            for link in links(topo)
            if stage in (link.source_stage, *(s for _, s, _ in link.receivers))
        ]
        if not found:
            return None
        self = cls()
        device = topo.stages[stage].device_of(replica)
        for link in found:
            spec = allocated.get(link.source)
            if spec is None:
                raise PipelineError(f"weight sync: no endpoint allocated for role {link.source}")
            endpoint, port = str(spec["endpoint"]), int(spec.get("nccl_port", 0))
            name = f"weights {link.source}->{','.join(link.targets)}"
            if link.source_stage == stage:
                sender = None
                if replica == 0:  # the other replicas hold the same weights (data parallel)
                    sender = WeightSender(
                        name,
                        endpoint,
                        link.identities,
                        run_id=run_id,
                        config_hash=config_hash,
                        secret=secret,
                        tier=link.tier,
                        device=device,
                        nccl_port=port,
                        listen_fd=int(spec.get("listen_fd", -1)),
                        nccl_listen_fd=int(spec.get("nccl_listen_fd", -1)),
                    )
                self.senders[link.source] = (link, sender)
                self.routes[(link.source, topo.dataflow[link.reshard_op].op)] = Via.SEND
            for rank, (role, s, r) in enumerate(link.receivers, start=1):
                if (s, r) == (stage, replica):
                    load = topo.dataflow[link.load_ops[link.targets.index(role)]]
                    staged = bool(load.params.get(STAGE_PARAM))
                    self.routes[(role, load.op)] = Via.STAGE if staged else Via.RECEIVE
                    self.receivers[role] = (
                        link,
                        WeightReceiver(
                            f"{name} @{stage}/{replica}",
                            endpoint,
                            identity(role, s, r),
                            stage=stage,
                            replica=replica,
                            role=role,
                            run_id=run_id,
                            config_hash=config_hash,
                            secret=secret,
                            tier=link.tier,
                            rank=rank,
                            world_size=1 + len(link.receivers),
                            device=device,
                            nccl_port=port,
                        ),
                    )
        return self

    async def start(self) -> None:
        for _, sender in self.senders.values():
            if sender is not None:
                sender.start()
        for _, receiver in self.receivers.values():
            await receiver.start()

    async def run(
        self,
        task: Task,
        via: Via,
        roles: dict[str, Any],
        params: dict[str, Any],
        in_worker: InWorker,
    ) -> Metrics:
        """Run a SEND or RECEIVE end of a link as the task's barrier."""
        timeout = float(params.get(TIMEOUT_PARAM) or DEFAULT_TIMEOUT_S)
        if via is Via.SEND:
            link, sender = self.senders[task.role]
            setting = f"dataflow[{link.reshard_op}].params.{TIMEOUT_PARAM}"
            return await self._send(link, sender, roles, params, in_worker, timeout, setting)
        receiver, setting = self._receiver(task)
        load = _loader(roles[task.role], params, in_worker)
        return await receiver.pull(load, timeout=timeout, setting=setting)

    def _receiver(self, task: Task) -> tuple[WeightReceiver, str]:
        """The receiving end of `task`'s link, and the dotted key of its timeout."""
        link, receiver = self.receivers[task.role]
        index = link.load_ops[link.targets.index(task.role)]
        return receiver, f"dataflow[{index}].params.{TIMEOUT_PARAM}"

    # -- staged receive ------------------------------------------------------------------
    # With max_offpolicy_steps > 0 the rollout's load_weights arrives while generate calls
    # of the next step are in flight; as a barrier it would wait for them, and the sender
    # (a barrier in the actor's process) with it, so training could not overlap generation.
    # `stage_weights: true` splits it: the stage host starts `stage` at once (buckets
    # received and acknowledged beside the generates, the sender released), and `apply`
    # runs as the barrier, loading the staged buckets once the generates are done. Cost: a
    # full copy of the weights held on the receiver until the barrier (shared-memory
    # buckets are copied out of their leases; NCCL buckets are already private).

    async def stage(self, task: Task) -> tuple[Staged, Metrics]:
        """Receive every bucket of one version into private memory (acknowledging each)."""
        receiver, setting = self._receiver(task)
        timeout = float(task.params.get(TIMEOUT_PARAM) or DEFAULT_TIMEOUT_S)
        staged: Staged = []

        async def keep(bucket: Bucket, last: bool, version: int) -> Metrics:
            own = {k: t.clone() if t.device.type == "cpu" else t for k, t in bucket.items()}
            staged.append((own, last, version))
            return {}

        metrics = await receiver.pull(keep, timeout=timeout, setting=setting)
        return staged, metrics

    async def apply(
        self,
        task: Task,
        staged: Awaitable[tuple[Staged, Metrics]],
        roles: dict[str, Any],
        params: dict[str, Any],
        in_worker: InWorker,
    ) -> Metrics:
        """The barrier half: load what `stage` received into the role, in order."""
        buckets, metrics = await staged
        load = _loader(roles[task.role], params, in_worker)
        loaded: Metrics = {}
        while buckets:
            loaded = await load(*buckets.pop(0))  # each bucket dropped once loaded
        return {**loaded, **metrics, "weight_sync/staged": 1.0}

    async def _send(
        self,
        link: WeightLink,
        sender: WeightSender | None,
        roles: dict[str, Any],
        params: dict[str, Any],
        in_worker: InWorker,
        timeout: float,
        setting: str,
    ) -> Metrics:
        role = roles[link.source]
        metrics: Metrics = {}
        if link.local_too:  # a colocated rollout as well: the in-process hand-off first
            _, local = await in_worker(role.handle, "reshard", {}, params)
            metrics.update(local)
        if sender is None:
            if role.is_sharded:
                # A rank of a sharded actor sends nothing, but gathering each bucket is
                # collective: it walks the same buckets as rank 0, then drops them.
                await in_worker(_drain, role.weight_buckets())
            return metrics
        if not type(role).sends_weights:
            raise BatchError(
                f"role {link.source} ({type(role).__name__}) cannot send weights to "
                f"{', '.join(link.targets)} in other stages: it has no weight_buckets()"
            )
        source = cast(WeightSource, role)
        given = params.get("version")
        version = int(given) if given is not None else int(source.version)
        buckets = source.weight_buckets()
        t_pull = 0.0

        async def next_bucket() -> Bucket | None:
            nonlocal t_pull
            t = time.perf_counter()
            # In the role's thread: a sharded actor may gather a bucket here.
            got = await in_worker(next, buckets, None)
            t_pull += time.perf_counter() - t
            return got

        metrics.update(await sender.push(next_bucket, version, timeout=timeout, setting=setting))
        metrics["weight_sync/gather_s"] = t_pull
        return metrics

    async def close(self) -> None:
        for _, sender in self.senders.values():
            if sender is not None:
                await sender.close()
        for _, receiver in self.receivers.values():
            await receiver.close()


def _loader(
    role: Any, params: dict[str, Any], in_worker: InWorker
) -> Callable[[Bucket, bool, int], Awaitable[Metrics]]:
    """One bucket into the receiving role (its load_weights op, in its worker thread)."""

    async def load(bucket: Bucket, last: bool, version: int) -> Metrics:
        _, metrics = await in_worker(
            role.handle, "load_weights", bucket, {**params, "last": last, "version": version}
        )
        return dict(metrics)

    return load


def _drain(buckets: Iterator[Bucket]) -> None:
    for _ in buckets:
        pass

"""The two ends of a weight link over the transport: `WeightSender` (ROUTER, bound by the
sending actor replica) and `WeightReceiver` (DEALER, one per receiving replica).

    receiver                                   sender
      Hello(pid, config hash, proof)      -->    admits the connection (transport/auth.py)
                                                 and knows who is there (and their pids)
                                          <--    Weights(v, 0, last=False) + bucket 0
                                          <--    Weights(v, 1, last=False) + bucket 1
      load(bucket 0)
      Weights(v, 0) without tensors: ack  -->    at most WINDOW buckets unacked per receiver
                                          <--    Weights(v, 2, ...)            ...
      ack of the `last` bucket            -->    `push` returns

Acks are per bucket *loaded*, not per shared-memory lease: a receiver may keep a bucket's
tensors a while (vLLM's layer-wise loader holds a layer's tensors until the layer is
complete); that costs pool memory, never a deadlock.

Tiers: "shm" (CPU: shm_threshold 0, so each bucket is one pooled segment per receiver,
mapped once and reused across syncs); "nccl" (CUDA both sides: a private NcclGroup, sender
rank 0, receivers 1..n, built at the first sync so neither side blocks its startup);
"gloo" (the NCCL tier's code over gloo on CPU, for tests).

Who may connect: a receiver's connection identity is `<role>@<stage>/<replica>#<random>`
and its Hello carries an HMAC of the run's secret over it (transport/auth.py); the sender's
ROUTER is gated, so a connection without that proof is refused and nothing it sends is
decoded past its header. Over TCP the sender adopts a socket the session bound and kept
listening (`listen_fd`), so nobody can take its port first.

Invariants: buckets of a version arrive as 0..n-1 ending with `last`, else PipelineError;
every wait ends by `timeout` (TransportTimeout naming the setting) or, for the sender, at
once when a receiver's process is gone (PeerDeadError naming it, version and bucket);
`close()` frees sockets, pooled segments and the NCCL group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from hybridflow.errors import BatchError, PeerDeadError, PipelineError, TransportTimeout
from hybridflow.pipeline.plan.weight_links import Tier, identity
from hybridflow.transport import auth
from hybridflow.transport.channel import Channel
from hybridflow.transport.liveness import pid_alive
from hybridflow.transport.protocol import Hello, Weights

log = logging.getLogger("hybridflow.weight_sync")

WINDOW = 2  # buckets sent and not yet acknowledged, per receiver: double buffering
DEFAULT_TIMEOUT_S = 300.0
Metrics = dict[str, float]
Bucket = dict[str, torch.Tensor]


class WeightSender:
    """The sending end of one link (ROUTER, bound). `push` sends one version."""

    def __init__(
        self,
        name: str,
        endpoint: str,
        receivers: tuple[bytes, ...],
        *,
        run_id: str,
        config_hash: str,
        secret: bytes,
        tier: Tier = "shm",
        device: torch.device | str = "cpu",
        nccl_port: int = 0,
        hwm: int = 64,
        listen_fd: int = -1,
        nccl_listen_fd: int = -1,
    ) -> None:
        self.name = name
        self.receivers = receivers
        self.config_hash = config_hash
        self.run_id, self._secret = run_id, secret
        self.tier, self.device, self.nccl_port = tier, torch.device(device), nccl_port
        self.nccl_listen_fd = nccl_listen_fd
        self.refused = 0  # connections that did not prove themselves
        self.chan = Channel(
            "router",
            endpoint,
            bind=True,
            gated=True,
            name=name,
            run_id=run_id,
            hwm=hwm,
            shm_threshold=0,
            listen_fd=listen_fd,
        )
        self.pids: dict[bytes, int] = {}
        self.acked: dict[bytes, int] = {}  # buckets of the current version acked, per receiver
        self.version = -1
        self.max_unacked = 0  # the most buckets one receiver had unacked (tests check WINDOW)
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._group: Any = None
        self._tier: Any = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._recv_loop(), name=f"{self.name}.recv")

    async def _recv_loop(self) -> None:
        try:
            while True:
                rx = await self.chan.recv()
                peer = rx.peer or b""
                msg = rx.msg
                if not rx.trusted:
                    self._admit(peer, msg)
                elif peer not in self.receivers:
                    log.warning("%s: message from unexpected peer %r dropped", self.name, peer)
                elif isinstance(msg, Hello):
                    log.debug("%s: repeated Hello of %r ignored", self.name, peer)
                elif isinstance(msg, Weights):
                    self._on_ack(peer, msg)
                else:
                    log.warning(
                        "%s: unexpected %s from %r dropped", self.name, type(msg).__name__, peer
                    )
                self._changed.set()
        except asyncio.CancelledError:
            raise  # close(): the link's teardown
        except BaseException as exc:  # not only Exception: a push must not wait for a dead loop
            if not isinstance(exc, PipelineError):
                log.error("%s: receive loop failed", self.name, exc_info=exc)
                exc = PipelineError(
                    f"{self.name}: receive loop failed: {type(exc).__name__}: {exc}"
                )
            self._error = exc
            self._changed.set()

    def _admit(self, conn: bytes, msg: Any) -> None:
        """A connection not admitted yet: only a Hello with the run's proof gets it in
        (as `<role>@<stage>/<replica>`, one of our receivers, once); anything else is
        refused, counted and logged, and the sync goes on."""
        name = b""
        if isinstance(msg, Hello) and len(msg.roles) == 1:
            name = identity(msg.roles[0], msg.stage, msg.replica)
        if (
            name not in self.receivers
            or self.chan.admitted(name)
            or not auth.verify(self._secret, self.run_id, msg.stage, msg.replica, conn, msg.proof)
        ):
            self.refused += 1
            if self.refused <= 10 or self.refused % 1000 == 0:
                log.warning(
                    "%s: %s from connection %r refused: not a receiver of this link with "
                    "the run's proof (%d refused so far)",
                    self.name,
                    type(msg).__name__,
                    conn,
                    self.refused,
                )
            return
        if msg.config_hash != self.config_hash:
            raise PipelineError(
                f"{self.name}: receiver {name.decode()} runs config "
                f"{msg.config_hash}, this stage {self.config_hash}"
            )
        self.chan.admit(conn, name)
        self.pids[name] = msg.pid

    def _on_ack(self, peer: bytes, msg: Weights) -> None:
        want = self.acked.get(peer, 0)
        if msg.policy_version != self.version or msg.bucket != want:
            raise PipelineError(
                f"{self.name}: {peer.decode()} acknowledged bucket {msg.bucket} of version "
                f"{msg.policy_version}; expected bucket {want} of version {self.version}"
            )
        self.acked[peer] = want + 1

    async def push(
        self,
        next_bucket: Callable[[], Awaitable[Bucket | None]],
        version: int,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        setting: str = "sync_timeout_s",
    ) -> Metrics:
        """Send one version, bucket by bucket, to every receiver; return once every
        receiver has loaded the last bucket. `next_bucket()` gives the next bucket or None."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + timeout
        where = f"version {version}"
        await self._wait(
            lambda: all(r in self.pids for r in self.receivers),
            deadline,
            setting,
            "receivers to connect",
            where,
        )
        await self._ensure_tier(timeout, setting)
        self.version, self.acked = version, {r: 0 for r in self.receivers}
        self.max_unacked = 0
        cur = await next_bucket()
        if cur is None:
            raise BatchError(f"{self.name}: the weight source yielded no bucket")
        n, nbytes, ack_wait = 0, 0, 0.0
        while cur is not None:
            nxt = await next_bucket()  # look ahead one bucket (views, no copy) to know `last`
            msg = Weights(policy_version=version, bucket=n, last=nxt is None)
            for r in self.receivers:
                tw = loop.time()
                where = f"version {version} bucket {n}"
                await self._wait(
                    lambda r=r, n=n: n - self.acked[r] < WINDOW,
                    deadline,
                    setting,
                    f"{r.decode()} to load bucket {n - WINDOW}",
                    where,
                )
                ack_wait += loop.time() - tw
                self.max_unacked = max(self.max_unacked, n + 1 - self.acked[r])
                await self._send(r, msg, cur, deadline, setting, where)
            nbytes += sum(t.numel() * t.element_size() for t in cur.values())
            cur, n = nxt, n + 1
        tw = loop.time()
        await self._wait(
            lambda: all(a == n for a in self.acked.values()),
            deadline,
            setting,
            "the last bucket to be loaded",
            f"version {version} bucket {n - 1}",
        )
        ack_wait += loop.time() - tw
        if self._tier is not None:
            # Every receiver loaded every bucket, so the transfers are done; this orders the
            # optimizer's later in-place writes after NCCL's reads of the parameters.
            self._tier.wait_sent()
        return {
            "weight_sync/send_s": loop.time() - t0,
            "weight_sync/ack_wait_s": ack_wait,
            "weight_sync/bytes": float(nbytes),
            "weight_sync/buckets": float(n),
            "weight_sync/receivers": float(len(self.receivers)),
        }

    async def _send(
        self, peer: bytes, msg: Weights, bucket: Bucket, deadline: float, setting: str, where: str
    ) -> None:
        remaining = max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            await self.chan.send(msg, bucket, to=peer, timeout=remaining, timeout_setting=setting)
        except PeerDeadError as exc:
            self.chan.forget_peer(peer, self.pids.get(peer))
            raise PeerDeadError(
                f"{self.name}: receiver {peer.decode()} is gone at {where}: {exc}"
            ) from exc

    async def _wait(
        self, cond: Callable[[], bool], deadline: float, setting: str, what: str, where: str
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._changed.clear()
            if self._error is not None:
                raise self._error
            if cond():
                return
            for peer, pid in self.pids.items():
                if not pid_alive(pid):
                    self.chan.forget_peer(peer, pid)
                    raise PeerDeadError(
                        f"{self.name}: receiver {peer.decode()} (pid {pid}) died during the "
                        f"weight sync ({where}, waiting for {what})"
                    )
            if loop.time() >= deadline:
                raise TransportTimeout(
                    f"{self.name}: waited too long for {what} ({where}); the op param "
                    f"`{setting}` bounds this wait (raise it if the receiver is just busy)"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(0.1, deadline - loop.time()))

    async def _ensure_tier(self, timeout: float, setting: str) -> None:
        if self.tier == "shm" or self._tier is not None:
            return
        from hybridflow.transport.nccl import NcclGroup, NcclTier

        backend = "gloo" if self.tier == "gloo" else "nccl"
        self._group = await asyncio.to_thread(
            NcclGroup,
            0,
            1 + len(self.receivers),
            master_port=self.nccl_port,
            master_listen_fd=self.nccl_listen_fd,
            device=self.device if backend == "nccl" else "cpu",
            timeout_s=timeout,
            setting=setting,
            backend=backend,
        )
        self._tier = NcclTier(self._group, {r: 1 + i for i, r in enumerate(self.receivers)})
        self.chan.codec.cuda = self._tier

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.chan.close()
        if self._group is not None:
            self._group.close()


class WeightReceiver:
    """The receiving end of one link (DEALER). `pull` receives and loads one version."""

    def __init__(
        self,
        name: str,
        endpoint: str,
        ident: bytes,
        *,
        stage: str,
        replica: int,
        role: str,
        run_id: str,
        config_hash: str,
        secret: bytes,
        tier: Tier = "shm",
        rank: int = 1,
        world_size: int = 2,
        device: torch.device | str = "cpu",
        nccl_port: int = 0,
        hwm: int = 64,
    ) -> None:
        self.name = name
        conn = auth.connection_identity(ident.decode())  # unguessable: nobody squats it
        self.hello = Hello(
            stage=stage,
            replica=replica,
            pid=os.getpid(),
            roles=[role],
            config_hash=config_hash,
            proof=auth.proof(secret, run_id, stage, replica, conn),
        )
        self.tier, self.rank, self.world_size = tier, rank, world_size
        self.device, self.nccl_port = torch.device(device), nccl_port
        self.chan = Channel(
            "dealer",
            endpoint,
            bind=False,
            name=name,
            run_id=run_id,
            identity=conn,
            hwm=hwm,
            shm_threshold=0,
        )
        self._group: Any = None

    async def start(self) -> None:
        await self.chan.send(self.hello, timeout=DEFAULT_TIMEOUT_S)

    async def pull(
        self,
        load: Callable[[Bucket, bool, int], Awaitable[Metrics]],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        setting: str = "sync_timeout_s",
    ) -> Metrics:
        """Receive buckets until `last`, handing each to `load(bucket, last, version)`;
        acknowledge each once loaded. Returns the last load's metrics plus ours."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + timeout
        await self._ensure_tier(timeout, setting)
        expect, version, first_s, nbytes = 0, -1, 0.0, 0
        while True:
            rx = await self.chan.recv(
                timeout=max(0.0, deadline - loop.time()), timeout_setting=setting
            )
            msg = rx.msg
            if not isinstance(msg, Weights):
                log.warning("%s: unexpected %s dropped", self.name, type(msg).__name__)
                continue
            if msg.bucket != expect or (expect and msg.policy_version != version):
                raise PipelineError(
                    f"{self.name}: got bucket {msg.bucket} of version {msg.policy_version}, "
                    f"expected bucket {expect}" + (f" of version {version}" if expect else "")
                )
            if expect == 0:
                first_s = loop.time() - t0
            version = msg.policy_version
            nbytes += sum(t.numel() * t.element_size() for t in rx.tensors.values())
            metrics = await load(rx.tensors, msg.last, version)
            del rx  # the bucket's tensors go: their shared-memory lease returns to the sender
            ack = Weights(policy_version=version, bucket=msg.bucket, last=msg.last)
            await self.chan.send(
                ack, timeout=max(0.0, deadline - loop.time()), timeout_setting=setting
            )
            expect += 1
            if msg.last:
                return {
                    **metrics,
                    "weight_sync/recv_s": loop.time() - t0,
                    "weight_sync/first_bucket_wait_s": first_s,
                    "weight_sync/bytes": float(nbytes),
                    "weight_sync/buckets": float(expect),
                }

    async def _ensure_tier(self, timeout: float, setting: str) -> None:
        if self.tier == "shm" or self._group is not None:
            return
        from hybridflow.transport.nccl import NcclGroup, NcclTier

        backend = "gloo" if self.tier == "gloo" else "nccl"
        self._group = await asyncio.to_thread(
            NcclGroup,
            self.rank,
            self.world_size,
            master_port=self.nccl_port,
            device=self.device if backend == "nccl" else "cpu",
            timeout_s=timeout,
            setting=setting,
            backend=backend,
        )
        self.chan.codec.cuda = NcclTier(self._group, 0)

    async def close(self) -> None:
        self.chan.close()
        if self._group is not None:
            self._group.close()

"""Liveness: heartbeats out, last-seen times in, a named error when a peer goes silent.

    Heartbeater  --Heartbeat every interval_s-->  peer's Channel.recv --seen()--> PeerTable
                                                                      deadline passed?
                                                                      -> PeerDeadError /
                                                                         StageDeadError

- `PeerTable` is plain bookkeeping (no sockets, no tasks): `seen(key)` on any message from
  a peer; `check()` raises for the first peer silent longer than `timeout_s` (or whose
  `alive()` probe, e.g. a child's `Popen.poll() is None`, says it exited). A Channel given
  a table calls `seen` on every message and wakes at `next_deadline()` while it waits, so
  a dead peer surfaces from `recv` within the bound instead of a hang. The coordinator
  keeps one for its stages (`Coordinator.seen`, read by `runtime/peers.check_liveness`,
  which adds what only it knows: exit statuses and the task a stage was running): this is
  the one last-seen table and silence rule of the code base.
- `Heartbeater` is one named asyncio task that sends `Heartbeat` on a channel every
  `interval_s`, never blocking (a peer that does not drain is the peer's problem, and the
  silence is what the other side detects).
Keys are whatever identifies the peer on its channel: the ROUTER identity (bytes), or
None for the single peer of a DEALER/PULL.

Invariant: an error names the peer (stage/replica/pid), how long it was silent, its last
task (step/mb) and the setting that bounds the wait (`setting`), so a user knows what to
raise if the peer was merely slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Protocol

from hybridflow.errors import PeerDeadError, StageDeadError
from hybridflow.transport.protocol import Heartbeat, Msg, StageState

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SETTING = "liveness.heartbeat_timeout_s"
# What a heartbeat reports of a stage's progress: (task ids running, task ids queued,
# seconds the worker thread has been busy without finishing anything).
Progress = tuple[list[int], list[int], float]


@dataclass
class PeerInfo:
    key: Hashable
    label: str
    last_seen: float
    stage: str = ""
    replica: int = -1
    pid: int = 0
    state: str = ""
    step: int | None = None
    mb_id: int | None = None
    alive: Callable[[], bool] | None = None


class PeerTable:
    """Last-seen time of every peer we depend on; raises when one is silent too long."""

    def __init__(
        self,
        timeout_s: float,
        *,
        setting: str = DEFAULT_TIMEOUT_SETTING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"{setting} must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.setting = setting
        self._clock = clock
        self._peers: dict[Hashable, PeerInfo] = {}

    # -- membership --------------------------------------------------------------------
    def add(
        self,
        key: Hashable,
        *,
        label: str | None = None,
        stage: str = "",
        replica: int = -1,
        pid: int = 0,
        alive: Callable[[], bool] | None = None,
    ) -> PeerInfo:
        """Start watching `key`; the clock starts now (a fresh peer gets a full timeout)."""
        if label is None:
            label = f"stage {stage!r} replica {replica}" if stage else f"peer {key!r}"
        info = PeerInfo(key, label, self._clock(), stage, replica, pid, alive=alive)
        self._peers[key] = info
        return info

    def remove(self, key: Hashable) -> PeerInfo | None:
        return self._peers.pop(key, None)

    def get(self, key: Hashable) -> PeerInfo | None:
        return self._peers.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._peers

    def __len__(self) -> int:
        return len(self._peers)

    def keys(self) -> list[Hashable]:
        return list(self._peers)

    # -- events ------------------------------------------------------------------------
    def seen(self, key: Hashable, msg: object = None) -> None:
        """A message came from `key` (unknown keys are ignored). Heartbeats update pid/state."""
        info = self._peers.get(key)
        if info is None:
            return
        info.last_seen = self._clock()
        if isinstance(msg, Heartbeat):
            info.state = msg.state
            if msg.pid:
                info.pid = msg.pid

    def note_task(self, key: Hashable, step: int | None, mb_id: int | None) -> None:
        """Record the last event given to `key`, for the error message if it dies."""
        info = self._peers.get(key)
        if info is not None:
            info.step, info.mb_id = step, mb_id

    # -- deadlines ---------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """Clock time at which the next peer expires (earlier if a peer has a probe)."""
        if not self._peers:
            return None
        deadline = min(p.last_seen for p in self._peers.values()) + self.timeout_s
        if any(p.alive is not None for p in self._peers.values()):
            deadline = min(deadline, self._clock() + min(0.5, self.timeout_s / 4))
        return deadline

    def expired(self) -> list[PeerInfo]:
        now = self._clock()
        return [p for p in self._peers.values() if self._dead_reason(p, now)]

    def pop_dead(self) -> tuple[PeerInfo, PeerDeadError] | None:
        """Stop watching the first peer that is dead or silent too long; return it with
        its error (the caller frees what it held for that peer, then raises)."""
        now = self._clock()
        for info in list(self._peers.values()):
            reason = self._dead_reason(info, now)
            if reason:
                del self._peers[info.key]
                return info, self.error(info, reason)
        return None

    def check(self) -> None:
        """Raise (and stop watching) the first peer that is dead or silent too long."""
        dead = self.pop_dead()
        if dead is not None:
            raise dead[1]

    def clock(self) -> float:
        return self._clock()

    def error(self, info: PeerInfo, reason: str) -> PeerDeadError:
        where = info.label + (f" (pid {info.pid})" if info.pid else "")
        last = ""
        if info.step is not None:
            last = f"; its last task was step {info.step} mb {info.mb_id}"
        text = (
            f"{where} {reason}{last}; `{self.setting}` = {self.timeout_s:g}s bounds this "
            "wait: raise it if that peer is merely slow"
        )
        if info.stage:
            return StageDeadError(
                text, stage=info.stage, replica=info.replica, step=info.step, mb_id=info.mb_id
            )
        return PeerDeadError(text)

    def _dead_reason(self, info: PeerInfo, now: float) -> str:
        if info.alive is not None and not info.alive():
            return "exited"
        silent = now - info.last_seen
        if silent > self.timeout_s:
            return f"sent nothing for {silent:.1f}s"
        return ""

    async def watch(self) -> None:
        """Sleep until some peer is dead, then raise its error. For a task of its own."""
        while True:
            self.check()
            deadline = self.next_deadline()
            delay = self.timeout_s if deadline is None else max(0.0, deadline - self._clock())
            await asyncio.sleep(delay + 1e-3)


class BeatChannel(Protocol):
    """What a Heartbeater needs of its channel (a `transport.channel.Channel`), typed here:
    the channel imports this module for `PeerTable`, never the other way round."""

    @property
    def closed(self) -> bool: ...

    def try_send(self, msg: Msg, *, to: bytes | None = None) -> bool: ...


class Heartbeater:
    """Sends `Heartbeat(stage, replica, seq, state, pid)` on `channel` every `interval_s`.

    `to`: for a ROUTER, the identity (or a callable giving the identities) to beat to.
    `state`: a callable giving the current `StageState` (default: READY).
    `progress`: a callable giving (running task ids, queued task ids, seconds the worker
    thread has been busy without finishing anything), reported in every heartbeat.
    """

    def __init__(
        self,
        channel: BeatChannel,
        *,
        stage: str,
        replica: int = 0,
        interval_s: float = 1.0,
        to: bytes | Callable[[], Iterable[bytes]] | None = None,
        state: Callable[[], StageState] | None = None,
        progress: Callable[[], Progress] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"liveness.heartbeat_interval_s must be > 0, got {interval_s}")
        self.channel = channel
        self.stage, self.replica, self.interval_s = stage, replica, interval_s
        self._to = to
        self._state = state
        self._progress = progress
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self.sent = 0
        self.skipped = 0

    def start(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"heartbeat:{self.stage}/{self.replica}"
            )
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def beat(self) -> None:
        """Send one heartbeat now (skipped, not queued, if the socket cannot take it)."""
        running, queued, busy_s = self._progress() if self._progress else ([], [], 0.0)
        msg = Heartbeat(
            stage=self.stage,
            replica=self.replica,
            seq=self._seq,
            state=self._state() if self._state else StageState.READY,
            pid=os.getpid(),
            running=running,
            queued=queued,
            worker_busy_s=max(0.0, busy_s),
        )
        self._seq += 1
        targets: Iterable[bytes | None]
        targets = list(self._to()) if callable(self._to) else [self._to]
        for to in targets:
            try:
                ok = self.channel.try_send(msg, to=to)
            except PeerDeadError as exc:
                log.debug("heartbeat %s/%s: %s", self.stage, self.replica, exc)
                ok = False
            if ok:
                self.sent += 1
            else:
                self.skipped += 1

    async def _run(self) -> None:
        while not self.channel.closed:
            self.beat()
            await asyncio.sleep(self.interval_s)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs on this host. A zombie counts as exited (it ran to
    its end; nobody reaped it yet); someone else's live process counts as alive. Reads
    /proc where there is one, else probes with signal 0."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no procfs
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

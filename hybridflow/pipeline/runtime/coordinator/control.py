"""Messages the coordinator sends every stage process outside a step's tasks.

    ControlCalls.call_all   a `Control` call (protocol.py: CheckpointSave) to every stage,
                            then wait for each one's `ControlDone`, bounded by a timeout
                            whose error names the stages that did not answer
    shutdown_peers          `Shutdown` to every connected stage (best effort)

Control calls have ids of their own, apart from task ids. While one is out, its stage
lists it in flight as task `-1 - control_id` (StagePeer.given), so the waiting report
shows it; its answer clears it (`answered`, called by the recv loop).
"""

from __future__ import annotations

import asyncio
import logging

from hybridflow.errors import HybridflowError, PipelineError
from hybridflow.pipeline.runtime.peers import StagePeer
from hybridflow.transport.channel import Channel
from hybridflow.transport.protocol import Control, ControlArgs, ControlDone, Shutdown

log = logging.getLogger("hybridflow.coordinator")


class ControlCalls:
    def __init__(self, chan: Channel, peers: dict[bytes, StagePeer], run_id: str) -> None:
        self.chan = chan
        self.peers = peers
        self.run_id = run_id
        self._waiting: dict[int, asyncio.Future[None]] = {}
        self._next = 0

    async def call_all(
        self, call: ControlArgs, *, step: int, label: str, timeout: float, what: str, hint: str
    ) -> None:
        """`call` to every stage process; returns when all answered. No answer within
        `timeout` (the setting liveness.control_timeout_s) -> PipelineError saying `what`
        waited, on whom, and `hint` (what to raise it for)."""
        loop = asyncio.get_running_loop()
        waits = []
        for ident, peer in self.peers.items():
            control_id = self._next
            self._next += 1
            fut: asyncio.Future[None] = loop.create_future()
            self._waiting[control_id] = fut
            waits.append(fut)
            msg = Control(run_id=self.run_id, control_id=control_id, step=step, call=call)
            peer.given(-1 - control_id, (label, step, -1))
            await self.chan.send(msg, to=ident)
        answers = asyncio.gather(*waits)
        # A run that fails meanwhile cancels this task; whatever the gather then holds is
        # read here, so asyncio does not log "exception was never retrieved" at teardown.
        answers.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await asyncio.wait_for(answers, timeout)
        except TimeoutError:
            late = [p.info.name for p in self.peers.values() if any(k < 0 for k in p.inflight)]
            raise PipelineError(
                f"{what}: no answer from {', '.join(late) or 'a stage'} "
                f"within liveness.control_timeout_s = {timeout:g} s ({hint})"
            ) from None

    def answered(self, peer: StagePeer, msg: ControlDone) -> None:
        waiter = self._waiting.pop(msg.control_id, None)
        if msg.run_id != self.run_id or waiter is None:
            log.warning("answer to unknown control call %d dropped", msg.control_id)
            return
        peer.answered(-1 - msg.control_id)
        if not waiter.done():
            waiter.set_result(None)


async def shutdown_peers(chan: Channel, peers: dict[bytes, StagePeer], reason: str) -> None:
    """Tell every connected stage to exit. Best effort: a dead peer is skipped."""
    for ident, peer in peers.items():
        if not peer.connected:
            continue
        try:
            await chan.send(Shutdown(reason=reason), to=ident, timeout=1.0)
        except HybridflowError as exc:
            log.debug("shutdown to %s not delivered: %s", peer.info.name, exc)

"""The channel's fast paths (channel/send.py, recv.py, wait.py): a message without tensors
skips the codec on send, and a receiver woken by the socket's fd receives without reading
ZMQ_EVENTS first. Neither may reorder, corrupt or lose a message next to tensor messages,
nor turn a wake-up that brings nothing into a hang or a missed timeout."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from hybridflow.errors import TransportTimeout
from hybridflow.transport.channel import Channel, Received
from hybridflow.transport.protocol import Ping, Task


def _task(i: int) -> Task:
    return Task(run_id="t", task_id=i, step=0, mb_id=i, policy_version=0, role="r", op="o")


def _message(i: int) -> tuple[Ping | Task, dict[str, torch.Tensor]]:
    """Message i of a mixed stream: no tensors, a tensor in a frame, one in shared memory."""
    if i % 3 == 0:
        return Ping(seq=i, t_ns=i), {}
    n = 1 << 10 if i % 3 == 1 else 1 << 19  # 4 KiB in a frame, 2 MiB in shared memory
    return _task(i), {"x": torch.arange(n, dtype=torch.float32) + i}


def _check(got: Received, i: int) -> None:
    msg, tensors = _message(i)
    assert got.msg == msg, (i, got.msg)
    assert got.tensors.keys() == tensors.keys(), i
    for name, t in tensors.items():
        assert torch.equal(got.tensors[name], t), (i, name)


async def test_messages_with_and_without_tensors_arrive_intact_and_in_order(
    endpoint: str, run_id: str
) -> None:
    """Both directions of a ROUTER/DEALER pair, the receiver asleep when each arrives (the
    fd wakes it) or with several queued (sent in bursts), shared-memory acks flowing back
    between them on the same sockets."""
    n = 60
    with (
        Channel("router", endpoint, bind=True, name="coord", run_id=run_id) as coord,
        Channel("dealer", endpoint, bind=False, name="stage", run_id=run_id, identity=b"s") as st,
    ):
        await st.send(Ping(seq=10**6, t_ns=0))  # a ROUTER knows a peer once it spoke
        assert (await coord.recv(timeout=10)).peer == b"s"

        async def echo() -> None:  # checks what it got, sends the same stream back
            for i in range(n):
                _check(await st.recv(timeout=10), i)
                await st.send(*_message(i))

        server = asyncio.create_task(echo())
        for i in range(n):
            await coord.send(*_message(i), to=b"s")
            if i % 10 < 5:  # half in lockstep, half queued behind each other
                _check(await coord.recv(timeout=10), i)
            elif i % 10 == 9:
                for j in range(i - 4, i + 1):
                    _check(await coord.recv(timeout=10), j)
        await server
        assert coord.bad_messages == st.bad_messages == 0
        assert coord.acks_received > 0 and st.acks_received > 0  # the acks were consumed


async def test_wake_ups_that_bring_no_message_neither_hang_nor_skip_the_timeout(
    endpoint: str, ipc_dir: str
) -> None:
    """A ROUTER receiver sleeps while peers connect and leave (its fd fires, no message) and
    while another task sends on the same socket (which wakes it to re-check): its recv still
    ends at its timeout, and the next message still arrives."""
    empty: list[Any] = []
    with (
        Channel("router", endpoint, bind=True, name="rx") as rx,
        Channel("dealer", endpoint, bind=False, name="peer", identity=b"p") as peer,
    ):
        try_recv = rx._try_recv

        def counting_try_recv() -> list[Any] | None:
            frames = try_recv()
            if frames is None:
                empty.append(None)
            return frames

        rx._try_recv = counting_try_recv  # type: ignore[method-assign]
        await peer.send(Ping(seq=0, t_ns=0))
        assert (await rx.recv(timeout=10)).peer == b"p"

        async def churn() -> None:
            for i in range(1000):
                with Channel("dealer", endpoint, bind=False, name=f"c{i}", identity=b"c%d" % i):
                    await asyncio.sleep(0.002)
                await rx.send(Ping(seq=i, t_ns=0), to=b"p")  # pokes the sleeping receiver

        busy = asyncio.create_task(churn())
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout, match=r"nothing received for 0\.5s"):
            await rx.recv(timeout=0.5)
        waited = time.monotonic() - t0
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)
        assert 0.5 <= waited < 3.0, waited
        await peer.send(Ping(seq=7, t_ns=7))
        got = await rx.recv(timeout=10)
        assert got.msg == Ping(seq=7, t_ns=7) and got.peer == b"p"
    assert empty, "no wake-up found the queue empty: the test did not exercise that path"

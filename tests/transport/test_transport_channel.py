"""Channel behaviour: backpressure bounds memory, waits end in errors that name their
setting, close releases everything, CUDA tiers import and refuse cleanly without CUDA."""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import subprocess
import sys

import pytest
import torch
import transport_peers as peers

from hybridflow.errors import PeerDeadError, PipelineError, TransportTimeout
from hybridflow.transport.channel import Channel
from hybridflow.transport.protocol import Ping, Pong, Task


def _shm_bytes(run_id: str) -> int:
    return sum(os.path.getsize(f"/dev/shm/{n}") for n in peers.shm_names(run_id))


async def _fill(tx: Channel, tensors: dict, limit: int) -> tuple[int, TransportTimeout]:
    """Send until a send blocks for 0.3 s; return how many went and the timeout."""
    for i in range(limit):
        try:
            await tx.send(peers._task(i), tensors, timeout=0.3)
        except TransportTimeout as exc:
            return i, exc
    raise AssertionError(f"{limit} sends to a consumer that reads nothing never blocked")


async def test_slow_consumer_blocks_the_sender_at_the_high_water_mark(
    endpoint: str, run_id: str
) -> None:
    hwm = 4
    with (
        Channel("push", endpoint, bind=True, name="tx", run_id=run_id, hwm=hwm) as tx,
        Channel("pull", endpoint, bind=False, name="rx", run_id=run_id, hwm=hwm) as rx,
    ):
        frame = {"x": torch.ones(1 << 14)}  # 64 KiB: tier 1, bytes ride in the message
        sent, exc = await _fill(tx, frame, 1000)
        # HWM on both sides plus what the kernel's socket buffers hold: a few messages,
        # never hundreds.
        assert hwm <= sent < 8 * hwm, sent
        assert "transport.send_timeout_s" in str(exc)
        for i in range(sent):  # nothing was lost or reordered while blocked
            got = await rx.recv(timeout=5)
            assert got.msg.task_id == i and torch.equal(got.tensors["x"], frame["x"])


async def test_shared_memory_in_flight_is_bounded_too(endpoint: str, run_id: str) -> None:
    cap = 8 << 20
    kw = {"run_id": run_id, "hwm": 1000, "shm_inflight_bytes": cap}
    with (
        Channel("push", endpoint, bind=True, name="tx", **kw) as tx,
        Channel("pull", endpoint, bind=False, name="rx", **kw) as rx,
    ):
        big = {"x": torch.ones(1 << 19)}  # 2 MiB: a one-shot segment per message
        sent, exc = await _fill(tx, big, 1000)
        assert sent == cap // (2 << 20)  # HWM would have let 1000 through
        assert _shm_bytes(run_id) <= cap
        assert "transport.shm_inflight_bytes" in str(exc)
        got = await rx.recv(timeout=5)  # the receiver opens one: room for one more
        assert torch.equal(got.tensors["x"], big["x"])
        await tx.send(peers._task(99), big, timeout=5)
        for _ in range(sent):
            got = await rx.recv(timeout=5)
        assert got.msg.task_id == 99
        del got
        gc.collect()
    assert peers.shm_names(run_id) == []


async def test_recv_timeout_names_the_setting(endpoint: str) -> None:
    with (
        Channel("pull", endpoint, bind=True, name="rx") as rx,
        pytest.raises(TransportTimeout, match=r"rx: nothing received for 0.05s.*`my\.key`"),
    ):
        await rx.recv(timeout=0.05, timeout_setting="my.key")


async def test_router_send_to_a_missing_peer_is_peer_dead(endpoint: str) -> None:
    with Channel("router", endpoint, bind=True, name="coord") as ch:
        with pytest.raises(PeerDeadError, match="'ghost' is not connected"):
            await ch.send(Ping(seq=1, t_ns=1), to=b"ghost")
        with pytest.raises(ValueError, match="needs `to=`"):
            await ch.send(Ping(seq=1, t_ns=1))


async def test_concurrent_recv_and_send_on_one_channel(endpoint: str, run_id: str) -> None:
    """Two tasks share a socket (edge-triggered fd): nobody sleeps through a message."""
    with (
        Channel("router", endpoint, bind=True, name="a", run_id=run_id) as a,
        Channel("dealer", endpoint, bind=False, name="b", run_id=run_id, identity=b"b") as b,
    ):
        # A ROUTER knows a peer only once it connected: the peer speaks first.
        await b.send(Pong(seq=0, t_ns=0))
        assert (await a.recv(timeout=10)).peer == b"b"

        async def echo(n: int) -> None:
            for _ in range(n):
                got = await b.recv(timeout=10)
                await b.send(Pong(seq=got.msg.seq, t_ns=0))

        server = asyncio.create_task(echo(300))
        pending = [asyncio.create_task(a.recv(timeout=10)) for _ in range(3)]
        got = []
        for i in range(300):
            await a.send(Ping(seq=i, t_ns=0), to=b"b")
            if i % 100 == 99:
                done = [await p for p in pending]
                got += [d.msg.seq for d in done]
                pending = [asyncio.create_task(a.recv(timeout=10)) for _ in range(3)]
        for p in pending:
            p.cancel()
        await server
        assert len(got) == 9 and len(set(got)) == 9


async def test_close_releases_everything_and_refuses_further_use(endpoint: str, run_id: str):
    tx = Channel("push", endpoint, bind=True, name="tx", run_id=run_id)
    with Channel("pull", endpoint, bind=False, name="rx", run_id=run_id):  # never reads
        await tx.send(peers._task(0), {"x": torch.ones(1 << 19)}, timeout=5)
        assert len(peers.shm_names(run_id)) == 1  # a segment nobody opened
        tx.close()
    tx.close()  # idempotent
    assert peers.shm_names(run_id) == []
    with pytest.raises(PipelineError, match="closed"):
        await tx.send(Ping(seq=0, t_ns=0))


async def test_task_with_bad_tensor_type_is_a_clear_error_and_leaks_nothing(
    endpoint: str, run_id: str
) -> None:
    with Channel("push", endpoint, bind=True, name="tx", run_id=run_id) as tx:
        with pytest.raises(TypeError, match="'y' is list"):
            await tx.send(Task(run_id="r", task_id=0, step=0, mb_id=0, policy_version=0,
                               role="r", op="o"), {"x": torch.ones(1 << 19), "y": [1]})  # fmt: skip
        assert peers.shm_names(run_id) == []


def test_importing_the_nccl_tier_turns_nvlink_multicast_off_unless_told_otherwise() -> None:
    """In a fresh interpreter whose environment names none of the keys (this process's
    may have them from its caller, which would prove nothing): importing the tier sets
    each; a value the environment already gives is kept."""
    keys = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
    code = (
        "import os, hybridflow.transport.nccl\n"
        f"print(' '.join(os.environ.get(k, '-') for k in {keys!r}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in keys}
    run = functools.partial(subprocess.run, [sys.executable, "-c", code], capture_output=True,
                            text=True, check=True, timeout=120)  # fmt: skip
    assert run(env=env).stdout.split() == ["0", "1", "1"]
    assert run(env={**env, "NCCL_NVLS_ENABLE": "1"}).stdout.split() == ["1", "1", "1"]


def test_cuda_tiers_import_cleanly_and_refuse_without_cuda() -> None:
    from hybridflow.transport import cuda_ipc, nccl

    if torch.cuda.is_available():
        pytest.skip("CUDA present: the GPU tests cover these tiers")
    assert not cuda_ipc.available() and not nccl.available()
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        cuda_ipc.CudaIpcTier()


async def test_undecodable_message_is_reported_to_the_owner_with_its_header(
    endpoint: str, run_id: str
) -> None:
    """A Task whose shared memory vanished before the receiver mapped it: dropped (counted),
    and `on_bad_message` gets the sender and the Task's header, so the owner can name the
    task it lost instead of waiting for it forever."""
    seen: list[tuple] = []
    kw = {"run_id": run_id, "shm_threshold": 0}
    with (
        Channel("router", endpoint, bind=True, name="rx", **kw) as rx,
        Channel("dealer", endpoint, bind=False, name="tx", identity=b"reward/0", **kw) as tx,
    ):
        rx.on_bad_message = lambda peer, exc, msg: seen.append((peer, str(exc), msg))
        task = Task(run_id="r", task_id=3, step=1, mb_id=2, policy_version=0, role="a", op="b")
        await tx.send(Ping(seq=0, t_ns=0))
        assert isinstance((await rx.recv(timeout=5)).msg, Ping)  # connected
        frames, descs, _ = tx._frames(task, {"x": torch.ones(4)}, None)
        for name in {d.where.name for d in descs}:
            os.unlink(f"/dev/shm/{name}")
        assert tx._try_send(frames)
        await tx.send(Ping(seq=1, t_ns=0))
        got = await rx.recv(timeout=5)  # the Task is skipped, the next message arrives
        assert isinstance(got.msg, Ping) and got.msg.seq == 1
    assert rx.bad_messages == 1
    ((peer, error, msg),) = seen
    assert peer == b"reward/0" and "does not exist" in error
    assert isinstance(msg, Task) and (msg.task_id, msg.step, msg.mb_id) == (3, 1, 2)

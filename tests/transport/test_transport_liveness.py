"""Liveness: a silent or killed peer becomes a named error within the heartbeat bound,
and the survivor leaves nothing in /dev/shm."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
import torch
import transport_peers as peers

from hybridflow.errors import PeerDeadError, StageDeadError
from hybridflow.transport.channel import Channel
from hybridflow.transport.liveness import Heartbeater, PeerTable
from hybridflow.transport.protocol import Heartbeat, Hello, Result, Task


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_peer_table_names_the_peer_its_last_task_and_the_setting() -> None:
    clock = FakeClock()
    table = PeerTable(2.0, clock=clock)
    table.add(b"a", stage="reward", replica=1, pid=42)
    table.add(b"b", label="coordinator")
    table.note_task(b"a", step=3, mb_id=5)
    clock.now += 1.5
    table.seen(b"b")
    table.check()  # nobody silent for > 2 s yet
    assert table.next_deadline() == pytest.approx(102.0)
    clock.now += 1.0
    with pytest.raises(StageDeadError) as err:
        table.check()
    e = err.value
    assert (e.stage, e.replica, e.step, e.mb_id) == ("reward", 1, 3, 5)
    text = str(e)
    for part in ("stage 'reward' replica 1", "pid 42", "2.5s", "step 3 mb 5"):
        assert part in text
    assert "`liveness.heartbeat_timeout_s` = 2s" in text
    assert b"a" not in table and b"b" in table  # reported once, then forgotten
    clock.now += 5
    with pytest.raises(PeerDeadError, match="coordinator sent nothing") as err2:
        table.check()
    assert not isinstance(err2.value, StageDeadError)


def test_peer_table_heartbeats_update_pid_and_state_and_probes_short_cut() -> None:
    clock = FakeClock()
    table = PeerTable(10.0, setting="custom.timeout", clock=clock)
    alive = [True]
    table.add(None, stage="actor", alive=lambda: alive[0])
    table.seen(None, Heartbeat(stage="actor", replica=0, seq=1, state="busy", pid=7))
    info = table.get(None)
    assert info is not None and (info.pid, info.state) == (7, "busy")
    assert table.next_deadline() <= clock.now + 0.5  # a probe is polled, not waited out
    alive[0] = False
    with pytest.raises(StageDeadError, match=r"exited.*`custom\.timeout`"):
        table.check()


def test_unknown_peers_are_ignored_and_bad_settings_rejected() -> None:
    table = PeerTable(1.0)
    table.seen(b"stranger")
    assert len(table) == 0 and table.next_deadline() is None
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        PeerTable(0)


async def test_heartbeats_keep_a_peer_alive_and_their_silence_kills_it(
    endpoint: str, run_id: str
) -> None:
    table = PeerTable(0.4)
    with (
        Channel("router", endpoint, bind=True, name="coord", run_id=run_id, peers=table) as rx,
        Channel("dealer", endpoint, bind=False, name="st", run_id=run_id, identity=b"s") as tx,
    ):
        table.add(b"s", stage="st", replica=0)
        beat = Heartbeater(tx, stage="st", interval_s=0.05)
        beat.start()
        t0 = time.monotonic()
        beats = 0
        while time.monotonic() - t0 < 1.0:  # 2.5 timeouts: alive thanks to heartbeats
            got = await rx.recv(timeout=5)
            assert isinstance(got.msg, Heartbeat) and got.msg.stage == "st"
            beats += 1
        assert beats >= 5
        await beat.stop()
        t_stop = time.monotonic()
        with pytest.raises(StageDeadError, match="stage 'st' replica 0"):
            while True:
                await rx.recv(timeout=30)
        assert time.monotonic() - t_stop < 0.4 + 5  # within the bound (+ slack for load)


async def test_killed_sender_mid_transfer_is_dead_within_the_bound_and_leaks_nothing(
    endpoint: str, run_id: str, spawn
) -> None:
    timeout_s = 1.0
    table = PeerTable(timeout_s)
    rx = Channel("router", endpoint, bind=True, name="coord", run_id=run_id, peers=table, hwm=4)
    child = spawn(peers.streaming_sender, endpoint, run_id, 2, 0.1)
    try:
        hello = await rx.recv(timeout=120)
        assert isinstance(hello.msg, Hello)
        table.add(hello.peer, stage="streamer", replica=3, pid=hello.msg.pid)
        got_tensors = 0
        while got_tensors < 5:  # it streams 2 MiB tensors through shm
            r = await rx.recv(timeout=10)
            if isinstance(r.msg, Task):
                assert r.tensors["x"].shape == (1 << 19,)
                assert int(r.tensors["x"][-1]) == (1 << 19) - 1
                got_tensors += 1
            del r
        await asyncio.sleep(0.3)  # let its queues fill: segments in flight when it dies
        assert len(peers.shm_names(run_id)) > 0
        child.kill()  # SIGKILL, mid-transfer
        child.join(10)
        t_kill = time.monotonic()
        with pytest.raises(StageDeadError) as err:
            while True:
                r = await rx.recv(timeout=30)
                del r
        waited = time.monotonic() - t_kill
        assert waited < timeout_s + 5, waited
        assert f"pid {hello.msg.pid}" in str(err.value)
        assert "liveness.heartbeat_timeout_s" in str(err.value)
        gc.collect()
        assert peers.shm_names(run_id) == []  # what it had in flight was swept
    finally:
        rx.close()
    assert peers.shm_names(run_id) == []


async def test_killed_receiver_is_dropped_and_the_sender_frees_its_segments(
    endpoint: str, run_id: str, spawn
) -> None:
    table = PeerTable(1.0)
    tx = Channel("router", endpoint, bind=True, name="coord", run_id=run_id, peers=table)
    child = spawn(peers.silent_receiver, endpoint, run_id, 0.1)
    try:
        hello = await tx.recv(timeout=120)
        table.add(hello.peer, label="hoarder")
        x = torch.ones(1 << 20)  # 4 MiB: pooled shm, held by the child forever
        for i in range(3):
            await tx.send(peers._task(i), {"x": x}, to=hello.peer)
            r = await tx.recv(timeout=10)
            while not isinstance(r.msg, Result):
                r = await tx.recv(timeout=10)
        assert tx.codec.shm_pool_in_flight(hello.peer) == 3
        child.kill()
        child.join(10)
        with pytest.raises(PeerDeadError, match="hoarder"):
            while True:
                await tx.recv(timeout=30)
        assert tx.codec.shm_pool_in_flight(hello.peer) == 0
        assert peers.shm_names(run_id) == []
        with pytest.raises(PeerDeadError, match="not connected"):
            await asyncio.wait_for(tx.send(peers._task(9), to=hello.peer), 10)
    finally:
        tx.close()
    assert peers.shm_names(run_id) == []


async def test_a_peer_whose_heartbeats_wait_in_our_queue_is_late_not_dead(
    endpoint: str, run_id: str
) -> None:
    table = PeerTable(0.3)
    with (
        Channel("router", endpoint, bind=True, name="coord", run_id=run_id, peers=table) as rx,
        Channel("dealer", endpoint, bind=False, name="st", run_id=run_id, identity=b"s") as tx,
    ):
        tx.try_send(Heartbeat(stage="st", replica=0, seq=0))
        assert isinstance((await rx.recv(timeout=5)).msg, Heartbeat)  # connected
        table.add(b"s", stage="st", replica=0)
        for seq in range(1, 6):  # our loop is busy for 0.5 s > the timeout; it keeps beating
            time.sleep(0.1)
            assert tx.try_send(Heartbeat(stage="st", replica=0, seq=seq))
        for seq in range(1, 6):
            got = await rx.recv(timeout=5)
            assert isinstance(got.msg, Heartbeat) and got.msg.seq == seq
        with pytest.raises(StageDeadError):  # and once the queue is empty, silence counts
            await rx.recv(timeout=5)

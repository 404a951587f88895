"""Malformed input through a real socket: thousands of random, truncated and bit-flipped
messages become counted ProtocolErrors; the receiver keeps serving; nothing executes."""

from __future__ import annotations

import random

import torch
import zmq
import zmq.asyncio

from hybridflow.transport import protocol
from hybridflow.transport.channel import Channel
from hybridflow.transport.protocol import Kind, Ping, Shutdown, Task

N = 3000


def _valid_messages(endpoint_dir: str) -> list[list[bytes]]:
    task = Task(
        run_id="r",
        task_id=1,
        step=2,
        mb_id=3,
        policy_version=4,
        role="actor",
        op="train",
        params={"lr": 0.1, "tag": "x"},
    )
    t = torch.arange(12, dtype=torch.float32)
    desc = protocol.TensorDesc(
        name="x", dtype="float32", shape=[12], nbytes=48, where=protocol.FrameRef(index=0)
    )
    shm_desc = protocol.TensorDesc(
        name="y",
        dtype="float32",
        shape=[4],
        nbytes=16,
        where=protocol.ShmRef(name="hybridflow-fuzz-0-1", offset=0, segment_bytes=64, lease=2),
    )
    return [
        [*protocol.encode(task, [desc]), t.numpy().tobytes()],
        [*protocol.encode(task, [shm_desc])],
        protocol.encode(Ping(seq=5, t_ns=6)),
        protocol.encode(protocol.Release(ids=[1], leases=[2], segments=["hybridflow-zz-1-2"])),
    ]


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = [bytearray(f) for f in frames]
    how = rng.randrange(7)
    if how == 0:  # random bytes everywhere
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 5))]
    if how == 1:  # truncate the header
        h = frames[1]
        frames[1] = h[: rng.randrange(0, len(h))]
    elif how == 2:  # flip bits in the header
        h = frames[1]
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(h))
            h[i] ^= 1 << rng.randrange(8)
    elif how == 3:  # drop or add frames
        if len(frames) > 1 and rng.random() < 0.5:
            frames.pop(rng.randrange(len(frames)))
        else:
            frames.append(bytearray(rng.randbytes(rng.randrange(0, 32))))
    elif how == 4:  # wrong kind byte
        frames[0] = bytearray([rng.choice([0, 12, 200, 255, Kind.TASK, Kind.PING])])
    elif how == 5:  # truncate a buffer frame
        if len(frames) > 2:
            frames[2] = frames[2][: rng.randrange(len(frames[2]))]
        else:
            frames[1] = frames[1] + rng.randbytes(3)
    else:  # wrong schema version
        frames[1][1:2] = bytes([rng.choice([0, 2, 7, 127])])
    return [bytes(f) for f in frames]


async def test_fuzzed_frames_are_counted_and_the_receiver_keeps_serving(
    endpoint: str, run_id: str
) -> None:
    rng = random.Random(1234)
    valid = _valid_messages(endpoint)
    ctx = zmq.asyncio.Context.instance()
    attacker = ctx.socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.setsockopt(zmq.SNDHWM, 0)
    rx = Channel("router", endpoint, bind=True, name="victim", run_id=run_id, hwm=0)
    attacker.connect(endpoint)
    try:
        for _ in range(N):
            await attacker.send_multipart(_mutate(rng, rng.choice(valid)))
        # An oversized multipart message (more parts than any message may have).
        await attacker.send_multipart([b"\x09", *[b""] * (protocol.MAX_FRAMES + 10)])
        await attacker.send_multipart(protocol.encode(Shutdown(reason="end of fuzz")))
        passed = 0
        while True:
            got = await rx.recv(timeout=30)
            if isinstance(got.msg, Shutdown):
                break
            passed += 1  # a mutation that happens to still be a valid message
        assert rx.bad_messages + passed + rx.acks_received == N + 1
        assert rx.bad_messages > 0.9 * N
        # Still serving: a real peer gets through, with tensors.
        with Channel("dealer", endpoint, bind=False, name="friend", run_id=run_id) as friend:
            await friend.send(Ping(seq=1, t_ns=2), {"x": torch.ones(3)})
            got = await rx.recv(timeout=10)
            assert got.msg == Ping(seq=1, t_ns=2) and torch.equal(got.tensors["x"], torch.ones(3))
    finally:
        attacker.close(0)
        rx.close()

"""Protocol: every message type round-trips; the frame layout is what the docs say; bad
input is a ProtocolError naming what was wrong."""

from __future__ import annotations

import msgspec
import pytest
import torch
import zmq

from hybridflow.errors import ProtocolError
from hybridflow.transport import protocol
from hybridflow.transport.channel import Channel
from hybridflow.transport.protocol import (
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    CudaIpcRef,
    FrameRef,
    Kind,
    NcclRef,
    ShmRef,
    TensorDesc,
)

SAMPLES: dict[Kind, protocol.Msg] = {
    Kind.HELLO: protocol.Hello(
        stage="rollout", replica=2, pid=1234, roles=["actor", "rollout"], config_hash="abc"
    ),
    Kind.WELCOME: protocol.Welcome(run_id="r1", accepted=False, reason="config hash differs"),
    Kind.HEARTBEAT: protocol.Heartbeat(stage="reward", replica=1, seq=7, state="busy", pid=99),
    Kind.TASK: protocol.Task(
        run_id="r1",
        task_id=5,
        step=3,
        mb_id=-1,
        policy_version=2,
        role="actor",
        op="optimizer_step",
        params={"lr": 1e-5, "name": "x", "flag": True, "none": None, "n": 3},
    ),
    Kind.RESULT: protocol.Result(
        run_id="r1",
        task_id=5,
        step=3,
        mb_id=0,
        policy_version=2,
        role="reward",
        op="score",
        metrics={"reward/mean": 0.5},
        info={"n": 4},
    ),
    Kind.FAILURE: protocol.Failure(
        stage="reward",
        replica=0,
        task_id=5,
        step=3,
        mb_id=1,
        role="reward",
        op="score",
        error_type="ValueError",
        message="boom",
        traceback="Traceback ...",
    ),
    Kind.RELEASE: protocol.Release(
        ids=[1, 2], leases=[3], segments=["hybridflow-r1-12-0"], unopened=[4]
    ),
    Kind.SHUTDOWN: protocol.Shutdown(reason="done"),
    Kind.PING: protocol.Ping(seq=1, t_ns=123),
    Kind.PONG: protocol.Pong(seq=1, t_ns=123),
    Kind.WEIGHTS: protocol.Weights(policy_version=4, bucket=2, last=True),
    Kind.CONTROL: protocol.Control(
        run_id="r1",
        control_id=3,
        step=9,
        call=protocol.CheckpointSave(dir="/tmp/ck/step-9.tmp", export=""),
    ),
    Kind.CONTROL_DONE: protocol.ControlDone(run_id="r1", control_id=3, metrics={"ckpt/s": 0.5}),
}

DESCS = [
    TensorDesc(name="a", dtype="bfloat16", shape=[2, 3], nbytes=12, where=FrameRef(index=0)),
    TensorDesc(
        name="b",
        dtype="float32",
        shape=[1 << 20],
        nbytes=4 << 20,
        where=ShmRef(name="hybridflow-r-1-0", offset=64, segment_bytes=(4 << 20) + 64, lease=3),
    ),
    TensorDesc(
        name="c",
        dtype="int64",
        shape=[4, 4],
        nbytes=128,
        where=CudaIpcRef(
            id=1,
            device=0,
            handle=b"h" * 64,
            storage_bytes=256,
            storage_offset_bytes=0,
            ref_counter_handle=b"/torch_1_2",
            ref_counter_offset=3,
            event_handle=b"e" * 64,
            event_sync_required=True,
            stride=[1, 4],
            offset=2,
        ),
    ),
    TensorDesc(name="d", dtype="bool", shape=[], nbytes=1, where=NcclRef(src=1, seq=9, device=1)),
]


def test_samples_cover_every_message_type() -> None:
    assert set(SAMPLES) == set(MESSAGE_TYPES)


@pytest.mark.parametrize("kind", list(MESSAGE_TYPES), ids=lambda k: k.name)
def test_every_message_type_round_trips(kind: Kind) -> None:
    msg = SAMPLES[kind]
    frames = protocol.encode(msg, DESCS)
    got, descs, buffers = protocol.decode([*frames, b"x" * 12])
    assert got == msg and type(got) is type(msg)
    assert descs == DESCS
    assert len(buffers) == 1


def test_frame_layout() -> None:
    msg = SAMPLES[Kind.TASK]
    kind, header = protocol.encode(msg, DESCS[:1])
    assert kind == bytes([Kind.TASK])
    v, body, tensors = msgspec.msgpack.decode(header)  # [v, body, tensors]: array-like
    assert v == SCHEMA_VERSION
    assert body["op"] == "optimizer_step" and "KIND" not in body
    assert tensors == [
        {
            "name": "a",
            "dtype": "bfloat16",
            "shape": [2, 3],
            "nbytes": 12,
            "where": {"type": "frame", "index": 0},
        }
    ]


async def test_frame_layout_on_the_wire(endpoint: str, run_id: str) -> None:
    """What a Channel puts on a real socket: [identity?] [kind] [header] [buffer...]."""
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.ROUTER)
    raw.bind(endpoint)
    try:
        with Channel("dealer", endpoint, bind=False, name="d", run_id=run_id, identity=b"me") as ch:
            small = torch.arange(6, dtype=torch.int16).reshape(2, 3)
            await ch.send(SAMPLES[Kind.PING], {"small": small, "big": torch.zeros(1 << 19)})
            assert raw.poll(5000)
            frames = raw.recv_multipart()
            ident, kind, header, *buffers = frames
            assert ident == b"me" and kind == bytes([Kind.PING])
            v, body, tensors = msgspec.msgpack.decode(header)
            assert (v, body) == (SCHEMA_VERSION, {"seq": 1, "t_ns": 123})
            assert [t["where"]["type"] for t in tensors] == ["frame", "shm"]
            assert buffers == [small.numpy().tobytes()]  # only tier-1 bytes ride as frames
            # The shm segment belongs to whoever decodes the message; nobody will: unlink.
            from hybridflow.transport.shm import open_segment

            open_segment(tensors[1]["where"]["name"], 0)
    finally:
        raw.close(0)


def _bad(frames: list[bytes], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        protocol.decode(frames)


def test_decode_rejects_bad_input_with_named_reasons() -> None:
    kind, header = protocol.encode(SAMPLES[Kind.PING])
    _bad([kind], "frame")
    _bad([b"\xff", header], "unknown message kind 255")
    _bad([b"\x09\x09", header], "kind frame must be 1 byte")
    _bad([kind, b"\x93\x63" + header[2:]], "schema version 99")
    _bad([kind, header[:-3]], "PING: invalid header")
    _bad([kind, b"\x01" * (protocol.MAX_HEADER_BYTES + 1)], "header is .* bytes >")
    _bad([bytes([Kind.TASK]), header], "TASK: invalid header")  # a Ping body is not a Task
    _bad([kind, header, b"stray"], "1 buffer frame")
    _bad([kind, b"\xc1"], "not a msgpack array")


def test_descriptors_are_validated() -> None:
    def with_desc(d: dict) -> list[bytes]:
        env = [SCHEMA_VERSION, {"seq": 1, "t_ns": 2}, [d]]
        return [bytes([Kind.PING]), msgspec.msgpack.encode(env)]

    frame = {"name": "x", "dtype": "float32", "shape": [2], "nbytes": 8}
    _bad([*with_desc({**frame, "where": {"type": "frame", "index": 1}}), b"x" * 8], "frame 1")
    _bad([*with_desc({**frame, "where": {"type": "frame", "index": 0}}), b"x" * 7], "7 bytes")
    _bad(with_desc({**frame, "dtype": "object", "where": {"type": "frame", "index": 0}}), "dtype")
    _bad(with_desc({**frame, "shape": [1] * 65, "where": {"type": "frame", "index": 0}}), "64")
    shm = {"type": "shm", "offset": 0, "segment_bytes": 8}
    _bad(with_desc({**frame, "where": {**shm, "name": "../etc/passwd"}}), "hybridflow-")
    _bad(with_desc({**frame, "where": {**shm, "name": "other-segment"}}), "hybridflow-")
    _bad(with_desc({**frame, "where": {**shm, "name": "hybridflow-x", "offset": 4}}), "runs past")
    _bad(with_desc({**frame, "where": {"type": "pickle", "data": b"..."}}), "invalid header")


def test_control_calls_are_typed_and_states_are_an_enum() -> None:
    """A control call's arguments are a tagged struct (an unknown call or argument is a
    malformed message), and a heartbeat's state outside StageState is rejected."""
    kind, header = protocol.encode(SAMPLES[Kind.CONTROL])
    env = msgspec.msgpack.decode(header)
    env[1]["call"]["type"] = "format_disk"
    _bad([kind, msgspec.msgpack.encode(env)], "CONTROL: invalid header")
    env[1]["call"] = {"type": "checkpoint_save", "dir": "/x", "rm_rf": True}
    _bad([kind, msgspec.msgpack.encode(env)], "CONTROL: invalid header")
    kind, header = protocol.encode(SAMPLES[Kind.HEARTBEAT])
    env = msgspec.msgpack.decode(header)
    env[1]["state"] = "sleeping"
    _bad([kind, msgspec.msgpack.encode(env)], "HEARTBEAT: invalid header")
    body, _, _ = protocol.decode(list(protocol.encode(SAMPLES[Kind.HEARTBEAT])))
    assert body.state is protocol.StageState.BUSY

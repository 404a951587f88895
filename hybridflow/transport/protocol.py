"""Every message hybridflow puts on a socket: typed, versioned MessagePack structs.

Frame layout of one message (ZeroMQ multipart; a ROUTER prefixes the peer identity):

    [kind: 1 byte] [header: msgpack Envelope(v, body, tensors)] [buffer 0] [buffer 1] ...

- `kind` says which struct `body` is, so the receiver picks a typed decoder before it
  reads a single field (vLLM's v1 engine does the same).
- `tensors` are descriptors only (name, dtype, shape, and where the bytes are: an
  extra frame, a shared-memory segment, a CUDA IPC handle, or an NCCL transfer).
  Tensor bytes never travel inside the header.
- Decoding validates everything (types, ranges, frame counts, sizes) and raises
  `ProtocolError`; it never executes or unpickles anything. A receiver that gets a
  bad message logs it and keeps serving.

Invariant: `SCHEMA_VERSION` changes whenever any struct here changes incompatibly; a
peer with another version is rejected at the handshake and on every message.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

import msgspec

from hybridflow.errors import ProtocolError

# 2: Heartbeat reports running/queued tasks; 3: Hello carries a proof; 4: Task.returns
SCHEMA_VERSION = 4
MAX_HEADER_BYTES = 1 << 20  # 1 MiB: headers are descriptors and small metadata only
MAX_FRAMES = 4096

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
MAX_NDIM = 64
# One tensor dimension / stride: bounded so that products stay far from int64 overflow.
Dim = Annotated[int, msgspec.Meta(ge=0, le=1 << 48)]
Shape = Annotated[list[Dim], msgspec.Meta(max_length=MAX_NDIM)]
Ident = Annotated[str, msgspec.Meta(max_length=256)]
# Scalars allowed in free-form parameter / metric maps (no nested objects: keeps decoding cheap
# and the schema honest; structured data gets its own field).
Scalar = int | float | str | bool | None

# dtype names on the wire -> torch dtypes live in tensors.py; this list is the contract.
DType = Literal[
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e5m2",
]


class StageState(enum.StrEnum):
    """A stage process's life-cycle state, as its heartbeats report it (validated on decode:
    a state outside this enum is a malformed message)."""

    CONNECTING = "connecting"  # Hello sent, no Welcome yet
    SETUP = "setup"  # roles being built (model loading may take minutes)
    READY = "ready"  # serving tasks, none running
    BUSY = "busy"  # serving tasks, at least one running
    FAILED = "failed"  # setup raised; waiting for Shutdown
    STOPPING = "stopping"  # Shutdown received or the parent died

    @property
    def serving(self) -> bool:
        return self in (StageState.READY, StageState.BUSY)


class Kind(enum.IntEnum):
    """One byte on the wire; the first frame of every message."""

    HELLO = 1
    WELCOME = 2
    HEARTBEAT = 3
    TASK = 4
    RESULT = 5
    FAILURE = 6
    RELEASE = 7
    SHUTDOWN = 8
    PING = 9
    PONG = 10
    WEIGHTS = 11
    CONTROL = 12
    CONTROL_DONE = 13


# ---------------------------------------------------------------------------------------
# Where tensor bytes are (a tagged union: the tag is the tier)


class FrameRef(msgspec.Struct, tag="frame", frozen=True):
    """Bytes are in extra multipart frame number `index` (0 = first buffer after header)."""

    index: NonNeg


# Only hybridflow's own segments can be named: a peer can never make a receiver open or
# unlink any other file in /dev/shm (no '/', fixed prefix).
ShmName = Annotated[str, msgspec.Meta(pattern=r"^hybridflow-[A-Za-z0-9_.\-]{1,200}$")]


class ShmRef(msgspec.Struct, tag="shm", frozen=True):
    """Bytes are in POSIX shared memory `name` at `offset`. The receiver unlinks the name
    when it first maps the segment.

    `lease` 0: a one-shot segment, freed when the receiver's tensors are gone.
    `lease` > 0: a pooled segment the sender reuses; the receiver keeps it mapped and sends
    `Release(leases=[lease])` once its tensors over this message are gone.
    """

    name: ShmName
    offset: NonNeg
    segment_bytes: NonNeg
    lease: NonNeg = 0


class CudaIpcRef(msgspec.Struct, tag="cuda_ipc", frozen=True):
    """A CUDA IPC memory handle (same host). The sender keeps the storage alive until the
    receiver sends `Release(ids=[id])`."""

    id: NonNeg
    device: NonNeg
    handle: bytes
    storage_bytes: NonNeg
    storage_offset_bytes: NonNeg
    ref_counter_handle: bytes
    ref_counter_offset: NonNeg
    event_handle: bytes
    event_sync_required: bool
    stride: Shape  # element strides of the tensor inside its storage
    offset: NonNeg  # element offset of the tensor inside its storage


class NcclRef(msgspec.Struct, tag="nccl", frozen=True):
    """Bytes follow as an NCCL send from global rank `src` in the transport's process group;
    `seq` orders transfers between the same pair of ranks."""

    src: NonNeg
    seq: NonNeg
    device: NonNeg


Location = FrameRef | ShmRef | CudaIpcRef | NcclRef


class TensorDesc(msgspec.Struct, frozen=True):
    name: Ident
    dtype: DType
    shape: Shape
    nbytes: NonNeg
    where: Location


# ---------------------------------------------------------------------------------------
# Message bodies. `KIND` is a class attribute (not a wire field).


class Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    KIND: ClassVar[Kind]


class Hello(Msg, frozen=True):
    """Stage -> coordinator (and weight receiver -> sender), first message: who I am,
    what config I run, and `proof` that I was launched by this run: an HMAC-SHA256 keyed
    by the run's secret over (run id, stage, replica, my socket identity); see auth.py.
    The config hash is public; the proof is what gets a peer in."""

    KIND: ClassVar[Kind] = Kind.HELLO
    stage: Ident
    replica: NonNeg
    pid: NonNeg
    roles: list[Ident]
    config_hash: Ident
    schema_version: NonNeg = SCHEMA_VERSION
    proof: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class Welcome(Msg, frozen=True):
    """Coordinator -> stage: handshake accepted (or not, with a reason)."""

    KIND: ClassVar[Kind] = Kind.WELCOME
    run_id: Ident
    accepted: bool
    reason: str = ""


# Task ids a heartbeat lists: a stage holds at most run.max_inflight (<= 1024) tasks.
TaskIds = Annotated[list[NonNeg], msgspec.Meta(max_length=MAX_FRAMES)]


class Heartbeat(Msg, frozen=True):
    """Stage -> coordinator every liveness.heartbeat_interval_s, from the stage's event
    loop. Besides "alive", it reports progress, so that a stuck worker thread (a deadlocked
    reward function) is caught by the task's deadline instead of looking alive forever:
    `running` tasks started and not answered (the coordinator's deadline clock of a task
    starts when it first sees it here), `queued` tasks received and not started (a task in
    neither list was never received: lost), `worker_busy_s` seconds since the worker
    thread last finished something while it is busy (0 when idle)."""

    KIND: ClassVar[Kind] = Kind.HEARTBEAT
    stage: Ident
    replica: NonNeg
    seq: NonNeg
    state: StageState = StageState.READY
    pid: NonNeg = 0  # lets a survivor sweep the dead peer's shared memory (shm.sweep_pid)
    running: TaskIds = []
    queued: TaskIds = []
    worker_busy_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class Task(Msg, frozen=True):
    """Coordinator -> stage: run `role.op` on one micro-batch (or on the whole step for
    barrier ops such as `optimizer_step` and `reshard`, where `mb_id` is -1)."""

    KIND: ClassVar[Kind] = Kind.TASK
    run_id: Ident
    task_id: NonNeg
    step: NonNeg
    mb_id: int
    policy_version: NonNeg
    role: Ident
    op: Ident
    params: dict[Ident, Scalar] = {}
    # What the stage sends back of the op's outputs: the job's declared outputs, and the
    # sample fields when the micro-batch holds rows the run records (samples.jsonl).
    # Named per task, not per process: the processes of a session serve several jobs
    # (training, validation), whose dataflows differ. None: everything the op returns.
    returns: list[Ident] | None = None


class Result(Msg, frozen=True):
    """Stage -> coordinator: outputs of a Task (tensors beside, metrics as floats)."""

    KIND: ClassVar[Kind] = Kind.RESULT
    run_id: Ident
    task_id: NonNeg
    step: NonNeg
    mb_id: int
    policy_version: NonNeg
    role: Ident
    op: Ident
    metrics: dict[Ident, float] = {}
    info: dict[Ident, Scalar] = {}


class Failure(Msg, frozen=True):
    """Stage -> coordinator: a Task raised, or the stage is going down."""

    KIND: ClassVar[Kind] = Kind.FAILURE
    stage: Ident
    replica: NonNeg
    task_id: int
    step: int
    mb_id: int
    role: Ident
    op: Ident
    error_type: Ident
    message: str
    traceback: str = ""


class Release(Msg, frozen=True):
    """Transport-internal resource acks; `Channel.recv` consumes these, callers never see them.

    receiver -> sender: `ids` CUDA IPC tensors and `leases` pooled shm leases it is done with,
    `unopened` CUDA IPC ids it never opened (its decoding failed: the sender returns their
    shares itself); sender -> receiver: `segments` pooled shm segments the sender retired.
    """

    KIND: ClassVar[Kind] = Kind.RELEASE
    ids: list[NonNeg]
    leases: list[NonNeg] = []
    segments: list[ShmName] = []
    unopened: list[NonNeg] = []


class Shutdown(Msg, frozen=True):
    KIND: ClassVar[Kind] = Kind.SHUTDOWN
    reason: str = ""


class Ping(Msg, frozen=True):
    KIND: ClassVar[Kind] = Kind.PING
    seq: NonNeg
    t_ns: NonNeg


class Pong(Msg, frozen=True):
    KIND: ClassVar[Kind] = Kind.PONG
    seq: NonNeg
    t_ns: NonNeg


class Weights(Msg, frozen=True):
    """Actor -> rollout engine: one bucket of a policy's weights (tensors beside).
    `last` marks the final bucket of `policy_version`."""

    KIND: ClassVar[Kind] = Kind.WEIGHTS
    policy_version: NonNeg
    bucket: NonNeg
    last: bool


# Control calls: what the coordinator asks of a stage PROCESS (not of a role's dataflow op),
# with typed arguments. Each kind of call is one tagged struct; the tag names the call. A
# stage runs a control call as a barrier (after every earlier task, before any later one)
# and answers ControlDone, or Failure (task_id = control_id, op = the tag) if it raised.
# Control ids are their own sequence: the scheduler's task ids never meet them.


class CheckpointSave(
    msgspec.Struct, tag="checkpoint_save", frozen=True, forbid_unknown_fields=True
):
    """Write every role's state_dict and the process RNG under `dir` (stage/replica
    subdirectory); with `export`, the actor also writes a HF `save_pretrained` there."""

    dir: str
    export: str = ""


ControlArgs = CheckpointSave  # a Union of tagged structs as control calls are added


class Control(Msg, frozen=True):
    KIND: ClassVar[Kind] = Kind.CONTROL
    run_id: Ident
    control_id: NonNeg
    step: NonNeg
    call: ControlArgs


class ControlDone(Msg, frozen=True):
    KIND: ClassVar[Kind] = Kind.CONTROL_DONE
    run_id: Ident
    control_id: NonNeg
    metrics: dict[Ident, float] = {}


MESSAGE_TYPES: dict[Kind, type[Msg]] = {
    cls.KIND: cls
    for cls in (
        Hello,
        Welcome,
        Heartbeat,
        Task,
        Result,
        Failure,
        Release,
        Shutdown,
        Ping,
        Pong,
        Weights,
        Control,
        ControlDone,
    )
}

M = TypeVar("M", bound=Msg)


class Envelope(msgspec.Struct, Generic[M], array_like=True, frozen=True):
    """The header frame: schema version, the typed body, tensor descriptors."""

    v: NonNeg
    body: M
    tensors: list[TensorDesc] = []


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Kind, msgspec.msgpack.Decoder] = {
    # Envelope parametrised at runtime by each message class (mypy sees a variable).
    kind: msgspec.msgpack.Decoder(Envelope[cls])  # type: ignore[valid-type]
    for kind, cls in MESSAGE_TYPES.items()
}
_KIND_BYTES = {kind: bytes([kind]) for kind in MESSAGE_TYPES}
# The kind byte -> Kind by a dict lookup: `Kind(byte)` is an enum call, a microsecond on
# every message received.
_KIND_OF: dict[int, Kind] = {int(kind): kind for kind in Kind}


def encode(msg: Msg, tensors: list[TensorDesc] | None = None) -> list[bytes]:
    """Return the first two frames `[kind, header]` of `msg`."""
    header = _encoder.encode(Envelope(v=SCHEMA_VERSION, body=msg, tensors=tensors or []))
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(
            f"{type(msg).__name__} header is {len(header)} bytes > {MAX_HEADER_BYTES}; "
            "put large data in tensors, not in params/info"
        )
    return [_KIND_BYTES[msg.KIND], header]


def decode(frames: list[Any]) -> tuple[Msg, list[TensorDesc], list[Any]]:
    """Validate and decode `[kind, header, *buffers]` -> (body, tensor descriptors, buffers).

    `frames` items may be bytes, memoryviews or zmq.Frame objects (anything with the
    buffer protocol). Raises `ProtocolError` for anything malformed; never anything else.
    """
    n = len(frames)
    if n < 2:
        raise ProtocolError(f"message has {n} frame(s); expected [kind, header, ...]")
    if n > MAX_FRAMES + 2:
        raise ProtocolError(f"message has {n} frames > {MAX_FRAMES + 2}")
    # Small frames arrive as bytes (channel/recv.py): the checks below are inlined for
    # them, a microsecond on every message received; anything else is viewed first.
    kind_frame = frames[0]
    if type(kind_frame) is not bytes:
        kind_frame = _as_view(kind_frame)
    if len(kind_frame) != 1:
        raise ProtocolError(f"kind frame must be 1 byte, got {len(kind_frame)}")
    kind = _KIND_OF.get(kind_frame[0])
    if kind is None:
        raise ProtocolError(f"unknown message kind {kind_frame[0]}")
    header = frames[1]
    if type(header) is not bytes:
        header = _as_view(header)
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(f"{kind.name} header is {len(header)} bytes > {MAX_HEADER_BYTES}")
    # Check the version before typed decoding so an old/new peer gets a precise message.
    # Envelope is array_like: [v, body, tensors], i.e. 0x93 then a positive fixint v.
    if len(header) < 2 or header[0] != 0x93 or header[1] != SCHEMA_VERSION:
        version = _peek_version(header)
        if version != SCHEMA_VERSION:
            raise ProtocolError(
                f"{kind.name}: schema version {version}, this process speaks "
                f"{SCHEMA_VERSION}; run the same hybridflow version on every process"
            )
    try:
        env = _decoders[kind].decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"{kind.name}: invalid header: {exc}") from exc
    buffers = list(frames[2:]) if n > 2 else []
    if env.tensors or buffers:  # with neither there is nothing to cross-check
        _check_tensor_frames(kind, env.tensors, buffers)
    return env.body, env.tensors, buffers


def _as_view(frame: Any) -> memoryview | bytes:
    if type(frame) is bytes:  # the common case (small frames arrive as bytes): no copy
        return frame
    if hasattr(frame, "buffer"):  # zmq.Frame
        view: memoryview = frame.buffer
        return view
    return memoryview(frame)


def _peek_version(header: memoryview | bytes) -> int:
    # Envelope is array_like: header = msgpack array [v, body, tensors]. Fast path: a
    # fixarray of 3 (0x93) followed by a positive fixint version, which is every valid header.
    if len(header) >= 2 and header[0] == 0x93 and header[1] < 0x80:
        return header[1]
    try:
        first = msgspec.msgpack.decode(header, type=list[Any])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"header is not a msgpack array: {exc}") from exc
    if not first or not isinstance(first[0], int) or isinstance(first[0], bool):
        raise ProtocolError("header does not start with an integer schema version")
    return first[0]


def _check_tensor_frames(kind: Kind, descs: list[TensorDesc], buffers: list[Any]) -> None:
    used: set[int] = set()
    names: set[str] = set()
    for d in descs:
        if d.name in names:
            raise ProtocolError(f"{kind.name}: tensor {d.name!r} described twice")
        names.add(d.name)
        if isinstance(d.where, FrameRef):
            i = d.where.index
            if i >= len(buffers):
                raise ProtocolError(
                    f"{kind.name}: tensor {d.name!r} points at frame {i}, "
                    f"message has {len(buffers)} buffer frame(s)"
                )
            if i in used:
                raise ProtocolError(f"{kind.name}: frame {i} claimed by two tensors")
            used.add(i)
            n = len(_as_view(buffers[i]))
            if n != d.nbytes:
                raise ProtocolError(
                    f"{kind.name}: tensor {d.name!r} frame has {n} bytes, descriptor says {d.nbytes}"
                )
        elif isinstance(d.where, ShmRef) and d.where.offset + d.nbytes > d.where.segment_bytes:
            raise ProtocolError(f"{kind.name}: tensor {d.name!r} runs past its shm segment")
    if len(used) != len(buffers):
        raise ProtocolError(
            f"{kind.name}: {len(buffers)} buffer frame(s) but {len(used)} referenced by tensors"
        )

"""hybridflow.transport: typed messages on ZeroMQ, tensors beside them, liveness.

    protocol.py   every message type (msgspec structs), frames [kind, header, *buffers]
    channel/      Channel: asyncio ZeroMQ socket, send(msg, tensors) / recv() -> Received;
                  its parts: wait.py (the socket on the event loop), gate.py (admitted
                  peers), send.py, recv.py, endpoint.py (the socket itself)
    tensors.py    TensorCodec: picks a tier per tensor, describes it, rebuilds it
    shm.py        tier 2: one-shot and pooled POSIX shared-memory segments, sweeps
    cuda_ipc.py   tier 3: CUDA IPC handles (same host), held until the receiver acks
    nccl.py       tier 4: NCCL send/recv in private per-direction communicators
    liveness.py   PeerTable (last-seen, named errors) and Heartbeater
    aio.py        the event loop (uvloop when installed)

Nothing here imports pipeline or stages code; nothing received is ever unpickled.
"""

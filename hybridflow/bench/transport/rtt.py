"""The round-trip tier (`rtt`): Ping -> Pong through the channels, against raw pyzmq.

Coordinator -> stage -> coordinator over ipc://, two processes, as in a run. The
reference is the same frames ping-ponged by plain blocking pyzmq ROUTER/DEALER sockets
between two other processes (`RawZmq`), timed in blocks alternating with the channels'
so that both see the same load (vs_raw_zmq = p50 / raw p50). This is the number the
channel's fast path is measured by (transport/channel/wait.py).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import torch
import zmq

from hybridflow.bench.transport.measure import StageProc, baselines, case, pct
from hybridflow.bench.transport.stage import STAGE_ID
from hybridflow.transport import protocol
from hybridflow.transport.channel import Channel
from hybridflow.transport.protocol import Ping


async def rtt_case(st: StageProc, iters: int) -> dict[str, Any]:
    """The `rtt` case: `iters` round trips on the stage's pooled channel, and raw ones."""
    ping = Ping(seq=1, t_ns=time.perf_counter_ns())
    nbytes = sum(len(f) for f in protocol.encode(ping))
    with RawZmq(st.directory) as raw:
        lat, raw_lat = await _rtt(st.chans["pooled"], raw, iters)
    base = baselines(torch.ones(nbytes, dtype=torch.uint8), 50)
    return case(
        "rtt",
        nbytes,
        statistics.median(lat) / 1e6,
        base,
        rtt_us_p50=pct(lat, 0.5),
        rtt_us_p99=pct(lat, 0.99),
        raw_zmq_rtt_us_p50=pct(raw_lat, 0.5),
        raw_zmq_rtt_us_p99=pct(raw_lat, 0.99),
        vs_raw_zmq=round(pct(lat, 0.5) / max(pct(raw_lat, 0.5), 1e-3), 2),
        iters=len(lat),
        what="Ping->Pong, two processes, ipc://; raw_zmq: the same frames echoed by "
        "blocking pyzmq ROUTER/DEALER, in blocks alternating with the channels'",
    )


async def _rtt(ch: Channel, raw: RawZmq, iters: int) -> tuple[list[float], list[float]]:
    """(channel, raw pyzmq) round trips in us, sorted: blocks of each in turn, so that a
    shared host's load changes hit both alike."""
    lat: list[float] = []
    raw_lat: list[float] = []
    block = max(1, min(250, iters // 10))
    warm = min(500, iters // 5)
    for i in range(warm):  # the first messages of a connection are slower; not counted
        await ch.send(Ping(seq=i, t_ns=0), to=STAGE_ID)
        await ch.recv(timeout=30)
        raw.ping()
    i = warm
    while len(lat) < iters:
        for _ in range(min(block, iters - len(lat))):
            t0 = time.perf_counter_ns()
            await ch.send(Ping(seq=i, t_ns=t0), to=STAGE_ID)
            await ch.recv(timeout=30)
            lat.append((time.perf_counter_ns() - t0) / 1e3)
            i += 1
        for _ in range(block):
            t0 = time.perf_counter_ns()
            raw.ping()
            raw_lat.append((time.perf_counter_ns() - t0) / 1e3)
    return sorted(lat), sorted(raw_lat)


def _raw_echo_main(endpoint: str) -> None:
    """The raw baseline's stage: a blocking DEALER that sends back whatever it gets."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send(b"hello")
    while True:
        frames = sock.recv_multipart()
        if frames == [b"stop"]:
            break
        sock.send_multipart(frames)
    sock.close()


class RawZmq:
    """Plain pyzmq round trips (no asyncio, no codec, no checks): ROUTER here, the echo
    DEALER in another process, the frames of an encoded Ping."""

    def __init__(self, directory: str) -> None:
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVTIMEO, 180_000)
        self._sock.bind(f"ipc://{directory}/raw.sock")
        self.proc = mp.get_context("spawn").Process(
            target=_raw_echo_main, args=(f"ipc://{directory}/raw.sock",), name="bench-raw-zmq"
        )
        self.proc.start()
        self._peer = self._sock.recv_multipart()[0]
        self._sock.setsockopt(zmq.RCVTIMEO, 30_000)
        self._frames = [self._peer, *protocol.encode(Ping(seq=1, t_ns=1))]

    def ping(self) -> None:
        self._sock.send_multipart(self._frames)
        self._sock.recv_multipart()

    def __enter__(self) -> RawZmq:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._sock.send_multipart([self._peer, b"stop"])
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
            self._sock.close()

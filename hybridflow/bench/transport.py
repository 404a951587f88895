"""`hybridflow bench transport --json`: what each transport tier costs, against a local copy.

Two processes, as in a run: this process is the coordinator (ROUTER, binds ipc://), a
spawned stage process connects (DEALER) and answers. Cases (one JSON object, `cases`):

  rtt        Ping -> Pong round trip, coordinator -> stage -> coordinator: rtt_us_p50/p99;
             raw_zmq_rtt_us_p50/p99: the same frames ping-ponged by plain blocking pyzmq
             ROUTER/DEALER sockets between two other processes, timed in blocks alternating
             with the channels' so that both see the same load (vs_raw_zmq = p50 / raw p50)
  frame      tier 1: a Task with tensors in ZeroMQ frames, stage acks: one-way hand-off
  shm        tier 2, pooled segments (ROUTER/DEALER with Release acks), stage acks
  shm_oneshot tier 2, a fresh segment per message (what PUSH/PULL or a full pool get)
  cuda_ipc   tier 3 (CUDA only): hand-off of a GPU tensor to another process, by handle
  nccl       tier 4 (2+ GPUs): streamed NCCL transfers; baseline = raw send/recv loop

Every case has `tier, bytes, seconds, gb_per_s, baseline_gb_per_s`: the baseline is a plain
in-process copy of the same bytes into an already-touched buffer (`dst.copy_(src)`),
measured in the same run (for 1 MiB and up, timed alternately with the hand-offs, so both
see the same load on a shared host); `baseline_alloc_copy_gb_per_s` adds the cost of
fresh memory (`src.clone()`). `seconds` is the median per message. Each size is verified
once (the stage returns a checksum of what it received) before it is timed.

Overrides (`--set`): rtt_iters, reps, sizes_mib (comma list), gpu_sizes_mib, cpu (0/1).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from hybridflow.errors import ConfigError
from hybridflow.transport import aio, protocol
from hybridflow.transport.channel import Channel
from hybridflow.transport.protocol import Hello, Ping, Pong, Result, Shutdown, Task

MiB = 1 << 20
STAGE_ID = b"bench-stage"


# ---------------------------------------------------------------------------------------
# settings


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    s: dict[str, Any] = {
        "rtt_iters": 2000 if quick else 10000,
        "reps": 5 if quick else 15,
        "sizes_mib": [1, 64] if quick else [1, 16, 64, 256, 1024],
        "frame_kib": [4, 64, 512] if quick else [4, 64, 256, 512],
        "oneshot_mib": [64] if quick else [64, 256],
        "gpu_sizes_mib": [1, 64, 1024] if quick else [1, 16, 256, 1024, 4096],
        "cpu": 1,  # 0: only the GPU tiers
    }
    for item in getattr(args, "overrides", None) or []:
        key, sep, value = item.partition("=")
        if not sep or key not in s:
            raise ConfigError(f"bench.transport.{key}", f"unknown override; known: {sorted(s)}")
        try:
            s[key] = [int(v) for v in value.split(",")] if isinstance(s[key], list) else int(value)
        except ValueError:
            raise ConfigError(
                f"bench.transport.{key}", f"expected integers, got {value!r}"
            ) from None
    return s


# ---------------------------------------------------------------------------------------
# the stage process


def _payload(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[nbytes] uint8 of varied bytes, made fast (a random MiB tiled)."""
    block = torch.randint(0, 256, (min(nbytes, MiB),), dtype=torch.uint8)
    reps = -(-nbytes // block.numel())
    return block.repeat(reps)[:nbytes].contiguous().to(device)


def _checksum(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    out = {}
    for name, t in tensors.items():
        b = t.detach().contiguous().reshape(-1)
        b = b.view(torch.uint8) if b.dtype != torch.bool else b.to(torch.uint8)
        out[name] = float(b.sum(dtype=torch.int64).item())  # exact below 2**53
    return out


def _stage_main(endpoints: dict[str, str], gpu: dict[str, Any] | None) -> None:
    aio.run(_stage(endpoints, gpu))


async def _stage(endpoints: dict[str, str], gpu: dict[str, Any] | None) -> None:
    group = None
    cuda = None
    if gpu is not None:
        torch.cuda.set_device(gpu["device"])
        if gpu["tier"] == "nccl":
            from hybridflow.transport.nccl import NcclGroup, NcclTier

            group = NcclGroup(1, 2, master_port=gpu["port"], device=gpu["device"])
            cuda = NcclTier(group, rank_of=0)
        else:
            from hybridflow.transport.cuda_ipc import CudaIpcTier

            cuda = CudaIpcTier()
    chans = [
        Channel(
            "dealer",
            ep,
            bind=False,
            name=f"stage-{key}",
            run_id="bench",  # the coordinator side's: shm names carry the run's prefix
            identity=STAGE_ID,
            cuda=cuda,
        )
        for key, ep in endpoints.items()
    ]
    for ch in chans:
        await ch.send(Hello(stage="bench", replica=0, pid=os.getpid(), roles=[], config_hash=""))
    stop = asyncio.Event()
    try:
        serving = [asyncio.create_task(_serve(ch, group, stop), name=ch.name) for ch in chans]
        await stop.wait()
        for task in serving:
            task.cancel()
        await asyncio.gather(*serving, return_exceptions=True)
    finally:
        for ch in chans:
            ch.close()
        if group is not None:
            group.close()


async def _serve(ch: Channel, group: Any, stop: asyncio.Event) -> None:
    streamed = 0
    while True:
        r = await ch.recv()
        if isinstance(r.msg, Shutdown):
            stop.set()
            return
        if isinstance(r.msg, Ping):
            await ch.send(Pong(seq=r.msg.seq, t_ns=r.msg.t_ns))
            continue
        if not isinstance(r.msg, Task):
            continue
        t = r.msg
        metrics: dict[str, float] = {}
        if t.op == "echo":
            await ch.send(_result(t), r.tensors)
            continue
        if t.op == "verify":
            metrics = _checksum(r.tensors)
        elif t.op == "stream":  # ack only the last of `count` messages
            streamed += 1
            if streamed < int(t.params.get("count", 1)):  # type: ignore[arg-type]
                continue
            streamed = 0
            torch.cuda.synchronize()
        elif t.op == "raw_recv" and group is not None:
            n, count = int(t.params["nbytes"]), int(t.params["count"])  # type: ignore[arg-type]
            buf = torch.empty(n, dtype=torch.uint8, device=group.device)
            for _ in range(count):
                group.irecv(buf, 0).wait()
            torch.cuda.synchronize()
        del r  # drop the received tensors before acking: their leases go back first
        await ch.send(_result(t, metrics))


def _result(t: Task, metrics: dict[str, float] | None = None) -> Result:
    return Result(
        run_id=t.run_id,
        task_id=t.task_id,
        step=t.step,
        mb_id=t.mb_id,
        policy_version=t.policy_version,
        role=t.role,
        op=t.op,
        metrics=metrics or {},
    )


def _task(op: str, i: int = 0, **params: Any) -> Task:
    return Task(
        run_id="bench",
        task_id=i,
        step=0,
        mb_id=0,
        policy_version=0,
        role="bench",
        op=op,
        params=params,
    )


# ---------------------------------------------------------------------------------------
# measurements


def _median_time(fn: Callable[[], Any], reps: int, sync: Callable[[], None] | None = None) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Copier:
    """The baseline: a plain in-process copy of `src`'s bytes into a touched buffer.

    Small copies are repeated until one timing is ~10 ms long (timer resolution)."""

    def __init__(self, src: torch.Tensor) -> None:
        self.src, self.dst = src, torch.empty_like(src)
        self.sync = torch.cuda.synchronize if src.is_cuda else None
        self.dst.copy_(src)
        fastest = min(self._time(1) for _ in range(5))  # one preempted copy must not decide
        self.inner = max(1, min(10000, int(0.01 / max(fastest, 1e-7))))

    def _time(self, n: int, fn: Callable[[], Any] | None = None) -> float:
        fn = fn or (lambda: self.dst.copy_(self.src))
        if self.sync:
            self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if self.sync:
            self.sync()
        return (time.perf_counter() - t0) / n

    def copy_s(self) -> float:
        return self._time(self.inner)

    def clone_s(self) -> float:
        return self._time(self.inner, self.src.clone)


def _baselines(src: torch.Tensor, reps: int) -> tuple[float, float]:
    """(copy into a touched buffer, clone into fresh memory) in GB/s, for `src`'s bytes."""
    c = _Copier(src)
    n = src.numel() * src.element_size()
    warm = statistics.median(c.copy_s() for _ in range(max(reps, 5)))
    fresh = statistics.median(c.clone_s() for _ in range(max(reps, 5)))
    return n / warm / 1e9, n / fresh / 1e9


def _case(tier: str, nbytes: int, seconds: float, base: tuple[float, float], **extra: Any) -> dict:
    """`base`: (baseline GB/s, the same into fresh memory or another reference GB/s)."""
    gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    case = {
        "tier": tier,
        "bytes": nbytes,
        "seconds": seconds,
        "gb_per_s": round(gbps, 3),
        "baseline_gb_per_s": round(base[0], 3),
        "vs_baseline": round(gbps / base[0], 3) if base[0] else None,
        "baseline_alloc_copy_gb_per_s": round(base[1], 3),
    }
    case.update(extra)
    return case


async def _handoff(
    ch: Channel, tensors: dict[str, torch.Tensor], reps: int, op: str
) -> tuple[float, tuple[float, float]]:
    """Median hand-off time (send -> the stage has the tensors -> its ack) and the
    baselines (GB/s) for the same bytes, timed alternately with the hand-offs so that
    both see the same machine (this host is shared: other work comes and goes)."""
    src = next(iter(tensors.values()))
    n = src.numel() * src.element_size()
    copier = _Copier(src)
    alternate = n >= MiB  # small copies take microseconds: alternating only adds wake-ups
    times, copies, clones = [], [], []
    for i in range(reps + 2):  # two warm-ups: segment creation, first page touches
        t0 = time.perf_counter()
        await ch.send(_task(op, i), tensors, to=STAGE_ID)
        await ch.recv(timeout=60, timeout_setting="bench rtt")
        if i >= 2:
            times.append(time.perf_counter() - t0)
            if alternate:
                copies.append(copier.copy_s())
                clones.append(copier.clone_s())
    if not alternate:
        copies = [copier.copy_s() for _ in range(max(reps, 5))]
        clones = [copier.clone_s() for _ in range(max(reps, 5))]
    base = (n / statistics.median(copies) / 1e9, n / statistics.median(clones) / 1e9)
    return statistics.median(times), base


async def _verify(ch: Channel, tensors: dict[str, torch.Tensor]) -> None:
    await ch.send(_task("verify"), tensors, to=STAGE_ID)
    got = await ch.recv(timeout=60)
    want = _checksum(tensors)
    if not isinstance(got.msg, Result) or got.msg.metrics != want:
        raise RuntimeError(f"transport bench: stage received {got.msg}, expected checksums {want}")


async def _rtt(ch: Channel, raw: _RawZmq, iters: int) -> tuple[list[float], list[float]]:
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


class _RawZmq:
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

    def __enter__(self) -> _RawZmq:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._sock.send_multipart([self._peer, b"stop"])
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
            self._sock.close()


def _pct(sorted_us: list[float], q: float) -> float:
    return round(sorted_us[min(len(sorted_us) - 1, int(q * len(sorted_us)))], 1)


class _StageProc:
    """The spawned stage and the coordinator's channels to it."""

    def __init__(self, keys: dict[str, dict[str, Any]], gpu: dict[str, Any] | None = None):
        self._dir = tempfile.mkdtemp(prefix="hf-bench-")
        self.chans = {
            key: Channel(
                "router",
                f"ipc://{self._dir}/{key}.sock",
                bind=True,
                name=f"coord-{key}",
                run_id="bench",
                **kw,
            )
            for key, kw in keys.items()
        }
        self.proc = mp.get_context("spawn").Process(
            target=_stage_main,
            args=({k: c.endpoint for k, c in self.chans.items()}, gpu),
            name="bench-stage",
            daemon=True,
        )

    async def __aenter__(self) -> _StageProc:
        self.proc.start()
        for ch in self.chans.values():
            hello = await ch.recv(timeout=180, timeout_setting="bench stage start-up")
            assert isinstance(hello.msg, Hello)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for ch in self.chans.values():
            try:
                await ch.send(Shutdown(reason="bench done"), to=STAGE_ID, timeout=5)
                break
            except Exception:  # the stage may already be gone; we only want it to exit
                pass
        await asyncio.get_running_loop().run_in_executor(None, self.proc.join, 30)
        if self.proc.is_alive():
            self.proc.kill()
        for ch in self.chans.values():
            ch.close()
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)


async def _cpu_cases(s: dict[str, Any]) -> list[dict]:
    cases: list[dict] = []
    keys = {
        "pooled": {},
        "oneshot": {"shm_pool_bytes": 0},
        "frames": {"shm_threshold": 1 << 30},
    }
    async with _StageProc(keys) as st:
        ping = Ping(seq=1, t_ns=time.perf_counter_ns())
        nbytes = sum(len(f) for f in protocol.encode(ping))
        with _RawZmq(st._dir) as raw:
            lat, raw_lat = await _rtt(st.chans["pooled"], raw, s["rtt_iters"])
        base = _baselines(torch.ones(nbytes, dtype=torch.uint8), 50)
        cases.append(
            _case(
                "rtt",
                nbytes,
                statistics.median(lat) / 1e6,
                base,
                rtt_us_p50=_pct(lat, 0.5),
                rtt_us_p99=_pct(lat, 0.99),
                raw_zmq_rtt_us_p50=_pct(raw_lat, 0.5),
                raw_zmq_rtt_us_p99=_pct(raw_lat, 0.99),
                vs_raw_zmq=round(_pct(lat, 0.5) / max(_pct(raw_lat, 0.5), 1e-3), 2),
                iters=len(lat),
                what="Ping->Pong, two processes, ipc://; raw_zmq: the same frames echoed by "
                "blocking pyzmq ROUTER/DEALER, in blocks alternating with the channels'",
            )
        )
        for kib in s["frame_kib"]:
            n = kib * 1024
            t = {"x": _payload(n)}
            await _verify(st.chans["frames"], t)
            lat = []
            for i in range(200 if kib <= 64 else 50):
                t0 = time.perf_counter_ns()
                await st.chans["frames"].send(_task("echo", i), t, to=STAGE_ID)
                await st.chans["frames"].recv(timeout=30)
                lat.append((time.perf_counter_ns() - t0) / 1e3)
            lat.sort()
            one_way, base = await _handoff(st.chans["frames"], t, s["reps"] * 4, "sink")
            cases.append(
                _case(
                    "frame",
                    n,
                    one_way,
                    base,
                    rtt_us_p50=_pct(lat, 0.5),
                    rtt_us_p99=_pct(lat, 0.99),
                    what="one-way hand-off (send -> stage has it -> ack); rtt: echoed back",
                )
            )
        for key, tier, sizes in (
            ("pooled", "shm", s["sizes_mib"]),
            ("oneshot", "shm_oneshot", s["oneshot_mib"]),
        ):
            for mib in sizes:
                n = mib * MiB
                t = {"x": _payload(n)}
                await _verify(st.chans[key], t)
                sec, base = await _handoff(st.chans[key], t, s["reps"], "sink")
                cases.append(
                    _case(
                        tier,
                        n,
                        sec,
                        base,
                        what="one-way hand-off (send -> stage has it -> ack)",
                    )
                )
                del t
    return cases


async def _cuda_ipc_cases(s: dict[str, Any]) -> list[dict]:
    from hybridflow.transport.cuda_ipc import CudaIpcTier

    cases: list[dict] = []
    dev = torch.device("cuda", 0)
    async with _StageProc({"ipc": {"cuda": CudaIpcTier()}}, gpu={"tier": "ipc", "device": 0}) as st:
        ch = st.chans["ipc"]
        for mib in s["gpu_sizes_mib"]:
            n = mib * MiB
            t = {"x": _payload(n, dev)}
            await _verify(ch, t)
            sec, base = await _handoff(ch, t, s["reps"], "sink")
            cases.append(
                _case(
                    "cuda_ipc",
                    n,
                    sec,
                    base,
                    handoff_us=round(sec * 1e6, 1),
                    what="hand-off to another process on the same GPU: send -> stage has "
                    "the tensor (zero-copy) -> ack; baseline: device-to-device copy",
                )
            )
            del t
    return cases


async def _nccl_cases(s: dict[str, Any]) -> list[dict]:
    from hybridflow.transport.nccl import NcclGroup, NcclTier

    port = _free_port()
    cases: list[dict] = []
    dev = torch.device("cuda", 0)
    gpu = {"tier": "nccl", "device": 1, "port": port}
    # The stage joins the group from its process; ours joins once the stage is spawned.
    st = _StageProc({"nccl": {}}, gpu=gpu)
    st.proc.start()
    loop = asyncio.get_running_loop()
    group = await loop.run_in_executor(None, lambda: NcclGroup(0, 2, master_port=port, device=dev))
    ch = st.chans["nccl"]
    ch.codec.cuda = NcclTier(group, rank_of={STAGE_ID: 1})
    try:
        hello = await ch.recv(timeout=180)
        assert isinstance(hello.msg, Hello)
        count = 8
        for mib in s["gpu_sizes_mib"]:
            n = mib * MiB
            x = _payload(n, dev)
            await _verify(ch, {"x": x})
            times, raw = [], []
            for rep in range(s["reps"] // 2 + 2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i in range(count):
                    await ch.send(_task("stream", i, count=count), {"x": x}, to=STAGE_ID)
                await ch.recv(timeout=120)
                times.append((time.perf_counter() - t0) / count)
                t0 = time.perf_counter()
                await ch.send(_task("raw_recv", nbytes=n, count=count), to=STAGE_ID)
                for _ in range(count):
                    group.isend(x, 1)
                await ch.recv(timeout=120)
                raw.append((time.perf_counter() - t0) / count)
                if rep < 2:
                    times.pop()
                    raw.pop()
            sec, raw_sec = statistics.median(times), statistics.median(raw)
            cases.append(
                _case(
                    "nccl",
                    n,
                    sec,
                    (n / raw_sec / 1e9, _baselines(x, s["reps"])[1]),
                    what=f"cuda:0 -> cuda:1, {count} messages streamed then one ack; "
                    "baseline: raw ProcessGroupNCCL send/recv loop of the same bytes between "
                    "the same processes (baseline_alloc_copy_gb_per_s: local clone on cuda:0)",
                )
            )
            del x
    finally:
        st.chans["nccl"].codec.cuda = None
        await st.__aexit__()
        group.close()
    return cases


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    s = _settings(args)
    t0 = time.perf_counter()
    cases = aio.run(_cpu_cases(s)) if s["cpu"] else []
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skipped = []
    if gpus >= 1:
        cases += aio.run(_cuda_ipc_cases(s))
    else:
        skipped.append("cuda_ipc: no CUDA device")
    if gpus >= 2:
        cases += aio.run(_nccl_cases(s))
    else:
        skipped.append("nccl: needs two CUDA devices")
    return {
        "bench": "transport",
        "quick": bool(getattr(args, "quick", False)),
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
        },
        "settings": s,
        "cases": cases,
        "skipped": skipped,
        "targets": _targets(cases),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def _targets(cases: list[dict]) -> dict[str, Any]:
    """The issue's targets, checked against this run's numbers (informational)."""
    out: dict[str, Any] = {}
    rtt = [c for c in cases if c["tier"] == "rtt"]
    if rtt:
        out["rtt_p50_le_100us"] = rtt[0]["rtt_us_p50"] <= 100
        out["rtt_p50_le_1.5x_raw_zmq"] = rtt[0]["vs_raw_zmq"] <= 1.5
    big = [c for c in cases if c["tier"] == "shm" and c["bytes"] >= 64 * MiB]
    if big:
        out["shm_ge_0.7x_copy_at_64MiB_plus"] = all(c["vs_baseline"] >= 0.7 for c in big)
    nccl = [c for c in cases if c["tier"] == "nccl" and c["bytes"] >= 64 * MiB]
    if nccl:
        out["nccl_ge_0.8x_raw_at_64MiB_plus"] = all(c["vs_baseline"] >= 0.8 for c in nccl)
    ipc = [c["handoff_us"] for c in cases if c["tier"] == "cuda_ipc"]
    if ipc:
        out["cuda_ipc_handoff_us_min_max"] = [min(ipc), max(ipc)]
    return out

"""The CPU tensor tiers: `frame` (tier 1, tensors in ZeroMQ frames), `shm` (tier 2,
pooled segments, acked) and `shm_oneshot` (tier 2, a fresh segment per message: what
PUSH/PULL or a full pool get), each a one-way hand-off (send -> the stage has the
tensors -> its ack) against a local copy; and the round trip (rtt.py), on the same
stage process.
"""

from __future__ import annotations

import time
from typing import Any

from hybridflow.bench.transport.measure import StageProc, case, handoff, pct, verify
from hybridflow.bench.transport.rtt import rtt_case
from hybridflow.bench.transport.stage import STAGE_ID, MiB, make_task, payload
from hybridflow.transport.channel import Channel


async def cpu_cases(s: dict[str, Any]) -> list[dict]:
    keys = {
        "pooled": {},
        "oneshot": {"shm_pool_bytes": 0},
        "frames": {"shm_threshold": 1 << 30},
    }
    async with StageProc(keys) as st:
        cases = [await rtt_case(st, s["rtt_iters"])]
        for kib in s["frame_kib"]:
            cases.append(await _frame_case(st.chans["frames"], kib, s["reps"]))
        for key, tier, sizes in (
            ("pooled", "shm", s["sizes_mib"]),
            ("oneshot", "shm_oneshot", s["oneshot_mib"]),
        ):
            for mib in sizes:
                cases.append(await _shm_case(st.chans[key], tier, mib, s["reps"]))
    return cases


async def _frame_case(ch: Channel, kib: int, reps: int) -> dict[str, Any]:
    n = kib * 1024
    t = {"x": payload(n)}
    await verify(ch, t)
    lat = []
    for i in range(200 if kib <= 64 else 50):
        t0 = time.perf_counter_ns()
        await ch.send(make_task("echo", i), t, to=STAGE_ID)
        await ch.recv(timeout=30)
        lat.append((time.perf_counter_ns() - t0) / 1e3)
    lat.sort()
    one_way, base = await handoff(ch, t, reps * 4, "sink")
    return case(
        "frame",
        n,
        one_way,
        base,
        rtt_us_p50=pct(lat, 0.5),
        rtt_us_p99=pct(lat, 0.99),
        what="one-way hand-off (send -> stage has it -> ack); rtt: echoed back",
    )


async def _shm_case(ch: Channel, tier: str, mib: int, reps: int) -> dict[str, Any]:
    n = mib * MiB
    t = {"x": payload(n)}
    await verify(ch, t)
    sec, base = await handoff(ch, t, reps, "sink")
    return case(tier, n, sec, base, what="one-way hand-off (send -> stage has it -> ack)")

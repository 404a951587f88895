"""`hybridflow bench reward --json`: how much of an external reward service's latency the
pipeline hides behind rollout.

Setup (all on this host, real processes and sockets):
  - a reward service built with the SDK (`start_server`), running in a thread of this
    process with its own event loop, whose function sleeps `latency_ms` per request
    (a stand-in for a judge model or a sandbox) and records every request;
  - a topology: synthetic rollout (`rollout_ms_per_sample` per sample, sleep) ->
    reward stage with the `http` (or `zmq`) backend calling that service ->
    synthetic actor update (cheap) -> step barrier (optimizer step, reshard, load).

The same topology runs twice: `mode: sequential` (all of rollout, then all scoring, ...)
and `mode: streamed` (micro-batch i is scored while rollout of i+1 runs). Then a burst of
requests from one client at high concurrency measures what the service path sustains.

Prints one JSON object:
  sequential_step_s / streamed_step_s   mean `timing/step` over steps after the first
                                        (the first one also opens connections)
  speedup                               sequential_step_s / streamed_step_s
  ideal_streamed_step_s                 rollout total + one micro-batch of scoring and
                                        training + step ops: the lower bound when the
                                        service latency is fully hidden
  hidden_fraction                       (sequential - streamed) / (reward time in
                                        sequential): 1.0 = scoring entirely overlapped
  service_requests_per_s_streamed       requests the service answered / streamed wall_s
  service_requests_per_s_burst          requests/s with `burst_concurrency` in flight
  reward_latency_ms_mean                client-side latency per request (streamed run)

Knobs: `--set bench.latency_ms=60 bench.protocol=zmq bench.rollout_ms_per_sample=10`,
any topology key (`--set run.steps=5`), `--quick` for a smaller run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from typing import Any

from hybridflow.config.loader import apply_overrides

BENCH_DEFAULTS: dict[str, Any] = {
    "latency_ms": 60.0,  # fixed service latency per request
    "protocol": "http",
    "rollout_ms_per_sample": 10.0,
    "train_ms_per_sample": 1.0,
    "service_max_batch": 4,  # items per request: 2 requests per micro-batch of 8
    "service_concurrency": 64,  # function calls the service runs at once
    "client_concurrency": 4,  # requests in flight per reward stage replica
    "burst_requests": 400,
    "burst_concurrency": 32,
}


class _Service:
    """The SDK server on a private loop in a daemon thread; counts requests."""

    def __init__(self, protocol: str, latency_s: float, max_batch: int, concurrency: int):
        self.latency_s = latency_s
        self.requests = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="bench-reward-service", daemon=True
        )
        self._thread.start()

        async def fixed_latency(prompts, responses, prompt_ids, response_ids, metadata):
            self.requests += 1
            await asyncio.sleep(self.latency_s)
            return [float(len(r)) for r in response_ids]

        from hybridflow.reward import start_server

        self.server = self.call(
            start_server(
                fixed_latency, protocol, port=0, max_batch=max_batch, concurrency=concurrency
            )
        )
        self.address = self.server.address

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        try:
            self.call(self.server.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()


def _topology(b: dict[str, Any], address: str, mode: str, quick: bool) -> dict[str, Any]:
    key = "url" if b["protocol"] == "http" else "endpoint"
    return {
        "name": f"bench-reward-{mode}",
        "seed": 0,
        "run": {
            "steps": 2 if quick else 4,
            "step_batch": 16 if quick else 64,
            "micro_batch": 8,
            "max_offpolicy_steps": 0,
            "mode": mode,
            "max_inflight": 2,
        },
        "data": {
            "source": "synthetic",
            "fields": ["prompt_ids"],
            "options": {"prompt_length": 16, "vocab_size": 1000},
        },
        "stages": {
            "rollout": {
                "roles": {
                    "rollout": {
                        "backend": "synthetic",
                        "options": {
                            "ms_per_sample": b["rollout_ms_per_sample"],
                            "work": "sleep",
                            "ops": {"load_weights": {"ms_per_task": 5}},
                        },
                    }
                }
            },
            "reward": {
                "roles": {
                    "reward": {
                        "backend": b["protocol"],
                        "options": {
                            key: address,
                            "max_batch": b["service_max_batch"],
                            "max_concurrency": b["client_concurrency"],
                            "timeout_s": 10.0,
                            "retries": 1,
                        },
                    }
                }
            },
            "actor": {
                "roles": {
                    "actor": {
                        "backend": "synthetic",
                        "options": {
                            "ms_per_sample": b["train_ms_per_sample"],
                            "work": "sleep",
                            "ops": {
                                "optimizer_step": {"ms_per_task": 5},
                                "reshard": {"ms_per_task": 5},
                            },
                        },
                    }
                }
            },
        },
        "dataflow": [
            {
                "role": "rollout",
                "op": "generate",
                "inputs": ["prompt_ids"],
                "outputs": ["response_ids"],
                "phase": "rollout",
            },
            {
                "role": "reward",
                "op": "score",
                "inputs": ["prompt_ids", "response_ids"],
                "outputs": ["rewards"],
                "phase": "reward",
            },
            {
                "role": "actor",
                "op": "update",
                "inputs": ["prompt_ids", "response_ids", "rewards"],
                "outputs": [],
                "phase": "train",
            },
            {"role": "actor", "op": "optimizer_step", "scope": "step", "phase": "train"},
            {
                "role": "actor",
                "op": "reshard",
                "scope": "step",
                "outputs": ["weights"],
                "phase": "reshard",
            },
            {
                "role": "rollout",
                "op": "load_weights",
                "scope": "step",
                "inputs": ["weights"],
                "phase": "reshard",
            },
        ],
        "metrics": {"backends": ["memory"]},
        "log_level": "WARNING",
    }


def _step_s(metrics: list[dict[str, float]]) -> float:
    steps = [m["timing/step"] for m in metrics]
    return statistics.mean(steps[1:] if len(steps) > 1 else steps)


async def _burst(protocol: str, address: str, n: int, concurrency: int) -> float:
    from hybridflow.reward import ClientConfig, make_client
    from hybridflow.reward.schema import Item

    client = make_client(
        protocol, address, ClientConfig(max_batch=1, max_concurrency=concurrency, timeout_s=30)
    )
    items = [Item(id=f"b{i}", response_ids=[1, 2, 3]) for i in range(n)]
    try:
        await client.score(items[:concurrency])  # warm the connections
        t0 = time.perf_counter()
        await client.score(items, step=1)
        return n / (time.perf_counter() - t0)
    finally:
        await client.aclose()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hybridflow.config.schema import load_topology
    from hybridflow.pipeline.runtime.runner import run_topology

    quick = bool(getattr(args, "quick", False))
    overrides = list(getattr(args, "overrides", []) or [])
    bench_sets = [o for o in overrides if o.startswith("bench.")]
    topo_sets = [o for o in overrides if not o.startswith("bench.")]
    b = apply_overrides({"bench": dict(BENCH_DEFAULTS)}, bench_sets)["bench"]
    unknown = sorted(set(b) - set(BENCH_DEFAULTS))
    if unknown:
        from hybridflow.errors import ConfigError

        raise ConfigError(
            f"bench.{unknown[0]}", f"unknown bench knob; known: {', '.join(BENCH_DEFAULTS)}"
        )
    if quick:
        b["burst_requests"] = min(int(b["burst_requests"]), 64)

    service = _Service(
        b["protocol"],
        float(b["latency_ms"]) / 1e3,
        int(b["service_max_batch"]),
        int(b["service_concurrency"]),
    )
    try:
        results = {}
        for mode in ("sequential", "streamed"):
            topo = load_topology(_topology(b, service.address, mode, quick), topo_sets)
            before = service.requests
            res = run_topology(topo)
            results[mode] = (topo, res, service.requests - before)
        burst_rps = service.call(
            _burst(
                b["protocol"],
                service.address,
                int(b["burst_requests"]),
                int(b["burst_concurrency"]),
            )
        )
    finally:
        service.close()

    topo, streamed, streamed_requests = results["streamed"]
    _, sequential, _ = results["sequential"]
    run_cfg = topo.run
    mbs = run_cfg.step_batch // run_cfg.micro_batch
    seq_s, str_s = _step_s(sequential.metrics), _step_s(streamed.metrics)
    seq_reward_s = statistics.mean(
        m.get("timing/reward", 0.0) for m in sequential.metrics[1:] or sequential.metrics
    )
    per_mb_rollout_s = run_cfg.micro_batch * b["rollout_ms_per_sample"] / 1e3
    per_mb_train_s = run_cfg.micro_batch * b["train_ms_per_sample"] / 1e3
    ideal = mbs * per_mb_rollout_s + b["latency_ms"] / 1e3 + per_mb_train_s + 0.015  # + step ops
    lat = [
        m["reward/service_latency_ms"] for m in streamed.metrics if "reward/service_latency_ms" in m
    ]
    return {
        "bench": "reward",
        "protocol": b["protocol"],
        "latency_ms": b["latency_ms"],
        "steps": run_cfg.steps,
        "micro_batches": mbs,
        "micro_batch": run_cfg.micro_batch,
        "requests_per_micro_batch": -(-run_cfg.micro_batch // int(b["service_max_batch"])),
        "sequential_step_s": round(seq_s, 4),
        "streamed_step_s": round(str_s, 4),
        "speedup": round(seq_s / str_s, 3),
        "ideal_streamed_step_s": round(ideal, 4),
        "efficiency": round(ideal / str_s, 3),
        "hidden_fraction": round((seq_s - str_s) / seq_reward_s, 3) if seq_reward_s else None,
        "sequential_reward_phase_s": round(seq_reward_s, 4),
        "reward_latency_ms_mean": round(statistics.mean(lat), 2) if lat else None,
        "service_requests_streamed": streamed_requests,
        "service_requests_per_s_streamed": round(streamed_requests / streamed.wall_s, 1),
        "service_requests_per_s_burst": round(burst_rps, 1),
        "burst_concurrency": int(b["burst_concurrency"]),
    }

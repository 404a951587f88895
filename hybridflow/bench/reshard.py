"""`hybridflow bench reshard --json [--quick]`: moving the actor's weights into the rollout
engine, per model size: time, bytes, and the plain tensor copy of the same bytes.

Per model preset, fp32 weights: real roles for `tiny` and `small`, then the parameter shapes
of `qwen2-0.5b`; `--quick` runs the same two modes at small sizes (real roles for `tiny`,
the shapes of `tiny`), so the smoke test exercises every path the full run takes:
  copy_s            `dst.copy_(src)` for every parameter into preallocated tensors: the
                    floor of any reshard that ends in another buffer on this host
  colocated_s       in process, what actor.reshard does in the hybrid engine:
                    `HFRollout.update_weights(actor.named_weights())`
  disaggregated_s   between two processes over the transport (pipeline/host/weight_sync.py):
                    actor.reshard -> rollout.load_weights, bucketed (weight_bucket_mb),
                    through pooled shared memory; the sender's time for one version,
                    from the first bucket until every bucket is loaded. With real roles
                    (mode "roles") it runs as a real two-stage run of the runtime and
                    `disaggregated_step_s` is the coordinator's view (the reshard phase,
                    dispatch to done); the first sync (segments created and first mapped)
                    is reported apart as `disaggregated_first_s`.
  bytes             bytes moved per sync (= the model's parameter bytes, one receiver)
  *_gbps            bytes / seconds
Mode "shapes" (qwen2-0.5b; tiny with --quick): building a random 0.5B model takes ~30 s per process on
this 2-core machine, so the two ends move tensors of the preset's exact parameter shapes
with the same sender/receiver code, and the receiver copies each bucket into its own
preallocated tensors as the hf rollout does; colocated_s is then not measured (it is the
same per-parameter copy as copy_s). The receiver reports a checksum of what it loaded;
`verified` says it matched the sender's weights.
The receiver process gets the link's secret as a run's stage does (its stdin pipe, never
argv or env) and proves itself with it; the sender refuses any other connection.
Threads: one torch thread everywhere (this process, the stage processes, the receiver):
this is memory-bound copying, and on this shared 2-core machine torch's 2-thread copy of
12 MB took ~130 ms against ~0.5 ms with one thread (the second OpenMP thread waits for a
core), which would make every figure measure the neighbours.
Every figure is the best (minimum) of several repetitions after a warm-up: on a shared
machine the minimum estimates what the code can do, a median measures the neighbours.
Compare within one run, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hybridflow.bench import refuse_sets
from hybridflow.config.schema import load_topology
from hybridflow.models.presets import preset_config
from hybridflow.models.tokenizer import builtin_tokenizer
from hybridflow.pipeline.host.weight_stream import WeightReceiver, WeightSender
from hybridflow.pipeline.host.weight_sync import identity
from hybridflow.pipeline.runtime.runner import run_topology
from hybridflow.stages.actor import Actor
from hybridflow.stages.actor_sync import size_buckets
from hybridflow.stages.base import StageContext
from hybridflow.stages.rollout.hf import HFRollout
from hybridflow.transport import aio, auth

BUCKET_MB = 64.0  # the actor's default weight_bucket_mb
THREADS = 1  # torch threads in every process of the bench (module docstring)


def run(args: argparse.Namespace) -> dict[str, Any]:
    refuse_sets(args, "reshard")
    quick = bool(getattr(args, "quick", False))
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    os.environ["OMP_NUM_THREADS"] = str(THREADS)  # the stage / receiver processes we start
    try:
        return _run(quick)
    finally:
        torch.set_num_threads(threads)
        os.environ.pop("OMP_NUM_THREADS", None)


ROLES_PRESETS = {"full": ("tiny", "small"), "quick": ("tiny",)}
SHAPES_PRESET = {"full": "qwen2-0.5b", "quick": "tiny"}


def _run(quick: bool) -> dict[str, Any]:
    # Quick and full differ in sizes only: both run every mode (a path only the full run
    # took once shipped broken).
    size = "quick" if quick else "full"
    reps = 3 if quick else 5
    sizes: list[dict[str, Any]] = [_roles_size(p, reps) for p in ROLES_PRESETS[size]]
    sizes.append(_shapes_size(SHAPES_PRESET[size], 3))
    return {
        "bench": "reshard",
        "bucket_mb": BUCKET_MB,
        "dtype": "float32",
        "quick": quick,
        "torch_threads": THREADS,
        "sizes": sizes,
    }


# ---------------------------------------------------------------------------------------
# Real roles: in process, and as a two-stage run


def _roles_size(preset: str, reps: int) -> dict[str, Any]:
    actor = _role(Actor, preset, {"weight_bucket_mb": BUCKET_MB})
    rollout = _role(HFRollout, preset, {})
    tensors = [t for _, t in actor.named_weights()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    out = {
        "preset": preset,
        "mode": "roles",
        "params": sum(t.numel() for t in tensors),
        "bytes": nbytes,
        "buckets": sum(1 for _ in actor.weight_buckets()),
        **_rate("copy", _copy_s(tensors, reps), nbytes),
    }

    def colocated() -> None:
        rollout.update_weights(actor.named_weights(), version=1)

    out.update(_rate("colocated", best_of(colocated, reps), nbytes))
    metrics = _two_stage_run(preset, reps + 1)  # step 0: the cold first sync
    warm = metrics[1:]
    send_s = min(m["weight_sync/send_s"] for m in warm)
    out.update(_rate("disaggregated", send_s, nbytes))
    out["disaggregated_step_s"] = round(min(m["timing/reshard"] for m in warm), 6)
    out["disaggregated_first_s"] = round(metrics[0]["weight_sync/send_s"], 6)
    out["bytes_moved"] = int(metrics[-1]["weight_sync/bytes"])
    return out


def _role(cls: type, preset: str, options: dict[str, Any]) -> Any:
    role = cls()
    role.setup(
        StageContext(
            stage="bench",
            replica=0,
            device=torch.device("cpu"),
            seed=0,
            run_dir=Path(tempfile.gettempdir()),
            options={"model": preset, "tokenizer": "builtin", **options},
        )
    )
    return role


def _two_stage_run(preset: str, steps: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="hf-bench-reshard-") as tmp:
        topo = load_topology(
            {
                "name": "bench-reshard",
                "run_dir": tmp,
                "run": {"steps": steps, "step_batch": 1, "micro_batch": 1},
                "data": {"source": "synthetic", "fields": ["prompt_ids"]},
                "stages": {
                    "trainer": {
                        "roles": {
                            "actor": {
                                "backend": "hf",
                                "options": {
                                    "model": preset,
                                    "tokenizer": "builtin",
                                    "weight_bucket_mb": BUCKET_MB,
                                },
                            }
                        }
                    },
                    "gen": {
                        "roles": {
                            "rollout": {
                                "backend": "hf",
                                "options": {"model": preset, "tokenizer": "builtin"},
                            }
                        }
                    },
                },
                "dataflow": [
                    {"role": "actor", "op": "reshard", "scope": "step", "phase": "reshard"},
                    {"role": "rollout", "op": "load_weights", "scope": "step", "phase": "reshard"},
                ],
                "liveness": {"heartbeat_timeout_s": 60.0, "startup_timeout_s": 300.0},
                "metrics": {"backends": ["memory"]},
            }
        )
        return run_topology(topo).metrics


# ---------------------------------------------------------------------------------------
# Preset shapes: the transport ends only (sender here, receiver in a child process)


def _shapes_size(preset: str, reps: int) -> dict[str, Any]:
    shapes = _param_shapes(preset)
    tensors = {name: torch.randn(shape) for name, shape in shapes}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    out: dict[str, Any] = {
        "preset": preset,
        "mode": "shapes",
        "params": sum(t.numel() for t in tensors.values()),
        "bytes": nbytes,
        "buckets": sum(1 for _ in _buckets(tensors, int(BUCKET_MB * (1 << 20)))),
        **_rate("copy", _copy_s(list(tensors.values()), reps), nbytes),
        "colocated_s": None,
    }
    times, loaded = aio.run(_send_versions(tensors, shapes, reps + 1))
    out.update(_rate("disaggregated", min(times[1:]), nbytes))
    out["disaggregated_first_s"] = round(times[0], 6)
    out["bytes_moved"] = nbytes
    out["verified"] = loaded == _checksum(tensors)
    if not out["verified"]:
        raise RuntimeError(f"bench reshard: the receiver loaded other weights ({preset})")
    return out


def _checksum(tensors: dict[str, torch.Tensor]) -> float:
    """One float of every weight, summed in name order (both ends compute it alike)."""
    return float(sum(float(tensors[n].double().sum()) for n in sorted(tensors)))


def meta_model(preset: str) -> Any:
    """The preset's causal LM (built-in tokenizer's vocabulary) on the meta device: its
    parameters' names and shapes, no memory."""
    from transformers import AutoModelForCausalLM

    tok = builtin_tokenizer()
    cfg = preset_config(
        preset,
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def _param_shapes(preset: str) -> list[tuple[str, list[int]]]:
    """(name, shape) of every parameter of the preset."""
    return [(n, list(p.shape)) for n, p in meta_model(preset).named_parameters()]


def _buckets(tensors: dict[str, torch.Tensor], limit: int) -> Iterator[dict[str, torch.Tensor]]:
    """Whole parameters, <= `limit` bytes a bucket (the actor's `weight_buckets` rule)."""
    return size_buckets(tensors.items(), limit)


async def _send_versions(
    tensors: dict[str, torch.Tensor], shapes: list[tuple[str, list[int]]], versions: int
) -> tuple[list[float], float | None]:
    """Push `versions` versions to a receiver process; (seconds per version, the
    receiver's checksum of what it loaded last, None if it sent none)."""
    with tempfile.TemporaryDirectory(prefix="hf-bench-") as tmp:
        endpoint = f"ipc://{tmp}/weights"
        ident = identity("rollout", "bench", 0)
        run_id = f"bench-reshard-{os.getpid()}"
        secret = auth.new_secret()
        sender = WeightSender(
            "bench weights", endpoint, (ident,), run_id=run_id, config_hash="bench", secret=secret
        )
        sender.start()
        child = subprocess.Popen(
            [sys.executable, "-P", "-m", "hybridflow.bench.reshard"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdin is not None and child.stdout is not None
        spec = {"endpoint": endpoint, "run_id": run_id, "secret": secret.hex()}
        child.stdin.write(json.dumps({**spec, "shapes": shapes, "n": versions}))
        child.stdin.close()
        times = []
        try:
            await _connected(sender, ident, child)  # the child's startup is not a sync
            for v in range(versions):
                buckets = _buckets(tensors, int(BUCKET_MB * (1 << 20)))

                async def next_bucket(it: Iterator[dict[str, torch.Tensor]] = buckets) -> Any:
                    return next(it, None)

                t0 = time.perf_counter()
                await sender.push(next_bucket, v, timeout=600.0)
                times.append(time.perf_counter() - t0)
        finally:
            await sender.close()
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            report = child.stdout.read()  # one short line: it fits the pipe
            child.stdout.close()
        if child.returncode:
            raise RuntimeError(f"bench receiver exited with code {child.returncode}")
        lines = report.strip().splitlines()
        return times, json.loads(lines[-1]).get("checksum") if lines else None


async def _connected(sender: WeightSender, ident: bytes, child: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300.0
    while ident not in sender.pids:
        if child.poll() is not None:
            raise RuntimeError(f"bench receiver exited with code {child.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError("bench receiver did not connect within 300 s")
        await asyncio.sleep(0.01)


async def _receive(spec: dict[str, Any]) -> None:
    """The child: preallocated weights of the preset's shapes, loaded bucket by bucket."""
    dst = {name: torch.zeros(shape) for name, shape in spec["shapes"]}
    receiver = WeightReceiver(
        "bench receiver",
        spec["endpoint"],
        identity("rollout", "bench", 0),
        stage="bench",
        replica=0,
        role="rollout",
        run_id=spec["run_id"],
        config_hash="bench",
        secret=bytes.fromhex(spec["secret"]),
    )
    await receiver.start()

    async def load(bucket: dict[str, torch.Tensor], last: bool, version: int) -> dict[str, float]:
        for name, t in bucket.items():
            dst[name].copy_(t)
        return {}

    try:
        for _ in range(int(spec["n"])):
            await receiver.pull(load, timeout=600.0)
    finally:
        await receiver.close()
    print(json.dumps({"checksum": _checksum(dst)}))  # stdout: the parent's report


# ---------------------------------------------------------------------------------------


def _copy_s(tensors: list[torch.Tensor], reps: int) -> float:
    dst = [torch.empty_like(t) for t in tensors]
    for d in dst:
        d.zero_()  # first touch outside the timing

    def once() -> None:
        for d, t in zip(dst, tensors, strict=True):
            d.copy_(t)

    return best_of(once, reps)


def best_of(fn: Any, reps: int) -> float:
    """The fastest of `reps` timed calls of `fn`, after one untimed warm-up call."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _rate(name: str, seconds: float, nbytes: int) -> dict[str, float]:
    return {
        f"{name}_s": round(seconds, 6),
        f"{name}_gbps": round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0,
    }


if __name__ == "__main__":  # the receiving process of the "shapes" mode
    aio.run(_receive(json.loads(sys.stdin.read())))

"""The `http` / `zmq` reward backends inside the real runtime: stage processes, the
coordinator, streamed micro-batches, against an SDK service on 127.0.0.1. (Two runs
only: each spawns three processes. Fallback and the other protocol are covered at the
role level in test_reward_role.py.)"""

from __future__ import annotations

import asyncio

import pytest
import torch

from hybridflow.bench.reward import BENCH_DEFAULTS, _topology
from hybridflow.config.schema import load_topology
from hybridflow.errors import PipelineError
from hybridflow.pipeline.runtime.runner import run_topology
from hybridflow.reward import start_server


def topology(protocol: str, address: str, run: dict | None = None, **options):
    knobs = {
        **BENCH_DEFAULTS,
        "protocol": protocol,
        "rollout_ms_per_sample": 0.0,
        "train_ms_per_sample": 0.0,
    }
    data = _topology(knobs, address, "streamed", quick=True)
    data["run"].update({"steps": 1, "step_batch": 16, "micro_batch": 8, **(run or {})})
    data["stages"]["reward"]["roles"]["reward"]["options"].update(options)
    return load_topology(data)


def echo_tag(prompts, responses, prompt_ids, response_ids, metadata):
    # the synthetic rollout puts the sample's tag (prompt_ids[:, 0]) in response column 0
    return [2.0 * r[0] for r in response_ids]


async def test_pipeline_scores_every_sample_through_the_service(tmp_path, monkeypatch):
    protocol = "http"
    monkeypatch.chdir(tmp_path)  # runs/<name>/ goes here
    async with await start_server(echo_tag, protocol, port=0) as srv:
        topo = topology(protocol, srv.address, max_batch=3)
        res = await asyncio.to_thread(run_topology, topo, collect=("prompt_ids", "rewards"))
    got = res.collected[0]
    prompts, rewards = torch.cat(got["prompt_ids"]), torch.cat(got["rewards"])
    assert rewards.dtype == torch.float32 and rewards.shape == (16,)
    assert torch.equal(rewards, 2.0 * prompts[:, 0].float())
    # a counter: summed over the step's 2 micro-batches of ceil(8 / 3) requests each
    assert res.metrics[0]["reward/service_requests"] == 6.0
    assert srv.core.calls == 6


async def test_pipeline_stops_with_an_error_naming_the_dead_service(
    tmp_path, monkeypatch, unused_tcp_port
):
    monkeypatch.chdir(tmp_path)
    endpoint = f"tcp://127.0.0.1:{unused_tcp_port}"
    topo = topology("zmq", endpoint, max_batch=8, timeout_s=0.3, retries=1, backoff_s=0.01)
    with pytest.raises(PipelineError) as info:
        await asyncio.to_thread(run_topology, topo)
    msg = str(info.value)
    assert endpoint in msg and "failed after 2 attempts" in msg and "samples 0-0-0, 0-0-1" in msg


async def test_fallback_counts_are_summed_over_the_steps_micro_batches(
    tmp_path, monkeypatch, unused_tcp_port
):
    """128 samples in 4 micro-batches, the service down: 128 fallbacks shown (not 32)."""
    monkeypatch.chdir(tmp_path)
    endpoint = f"tcp://127.0.0.1:{unused_tcp_port}"
    topo = topology(
        "zmq",
        endpoint,
        run={"step_batch": 128, "micro_batch": 32},
        max_batch=64,
        timeout_s=0.2,
        retries=0,
        on_failure={"fallback": 0.0},
    )
    res = await asyncio.to_thread(run_topology, topo)
    row = res.metrics[0]
    assert row["reward/service_failures"] == 128.0
    assert row["reward/service_requests"] == 4.0  # 1 attempt per micro-batch (max_batch 64)

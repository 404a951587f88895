"""`hybridflow bench rollout --json [--quick]`: generated tokens per second of the `hf`,
`native` and `vllm` rollout backends on the same prompts, weights and sampling settings;
for `native` also tok/s by concurrency (the prompts split into k micro-batches whose
`generate` calls are in flight together, as the rollout stage runs them).

Both backends are set up as a rollout stage sets them up (same preset, same seed, so the
same initial weights) in this process, and run the `generate` op on one batch of prompts:
one untimed warm-up call, then `reps` timed calls; the figure is the median of
(generated tokens / wall seconds of the call). Every sample generates exactly
`max_new_tokens` tokens (EOS does not stop it), so both backends do the same work.
Reported per backend: tokens_per_s, tokens per call, call seconds, startup_s (setup,
including vLLM's engine start), and `vllm_over_hf` (the ratio of tokens/s).

vLLM is measured only where it can be imported (on this CPU machine: in `.venv-vllm`, so
run `.venv-vllm/bin/python -m hybridflow bench rollout --json`); elsewhere the result
says `"vllm": "not installed"`. Default model: `small` (Qwen2-shaped, 4 layers, hidden
256, head_dim 64, which vLLM's CPU attention accepts); --quick: `tiny-vllm`, fewer and
shorter samples. Wall-clock on a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hybridflow.config.schema import load_topology
from hybridflow.stages.base import StageContext
from hybridflow.stages.rollout.vllm_compat import vllm_available

SEED = 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    settings = _settings(args, quick)
    prompts = _prompts(settings["prompts"], settings["prompt_len"], settings["model"])
    out: dict[str, Any] = {"bench": "rollout", "quick": quick, **settings}
    with tempfile.TemporaryDirectory(prefix="hf-bench-rollout-") as run_dir:
        out["hf"] = _measure("hf", settings, prompts, Path(run_dir))
        out["native"] = _measure("native", settings, prompts, Path(run_dir))
        out["native_over_hf"] = round(out["native"]["tokens_per_s"] / out["hf"]["tokens_per_s"], 3)
        if vllm_available():
            # vLLM logs to stdout; the bench's stdout is its JSON.
            with contextlib.redirect_stdout(sys.stderr):
                out["vllm"] = _measure("vllm", settings, prompts, Path(run_dir))
            out["vllm_over_hf"] = round(out["vllm"]["tokens_per_s"] / out["hf"]["tokens_per_s"], 3)
        else:
            out["vllm"] = "not installed"
    out["torch_threads"] = torch.get_num_threads()
    return out


def _settings(args: argparse.Namespace, quick: bool) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "model": "tiny-vllm" if quick else "small",
        "prompts": 4 if quick else 32,
        "prompt_len": 16,
        "max_new_tokens": 8 if quick else 128,
        "temperature": 1.0,
        "top_p": 1.0,
        "reps": 1 if quick else 3,
        "device": "cpu",
    }
    # `--set key=value` overrides one of these (e.g. --set model=tiny-vllm --set prompts=64).
    for item in getattr(args, "overrides", []) or []:
        key, _, value = item.partition("=")
        if key not in settings:
            from hybridflow.errors import ConfigError

            raise ConfigError(key, f"not a bench rollout setting; known: {', '.join(settings)}")
        settings[key] = type(settings[key])(value) if key != "model" else value
    return settings


def _prompts(count: int, length: int, model: str) -> dict[str, torch.Tensor]:
    """`count` random prompts of `length` tokens (the synthetic data source, seeded)."""
    from hybridflow.models.tokenizer import builtin_tokenizer
    from hybridflow.pipeline.sources.registry import create_source

    vocab = len(builtin_tokenizer())
    cfg = load_topology(
        {
            "name": "bench-rollout",
            "stages": {"s": {"roles": {"rollout": {"backend": "hf"}}}},
            "dataflow": [{"role": "rollout", "op": "generate"}],
            "data": {
                "source": "synthetic",
                "fields": ["prompt_ids", "prompt_mask"],
                "options": {"prompt_length": length, "vocab_size": vocab},
            },
        }
    ).data
    source = create_source(cfg, SEED)
    try:
        return source.batch(0, count)
    finally:
        source.close()


def _measure(
    backend: str, s: dict[str, Any], prompts: dict[str, torch.Tensor], run_dir: Path
) -> dict[str, Any]:
    from hybridflow.stages import create_role

    role = create_role("rollout", backend)
    options: dict[str, Any] = {
        "model": s["model"],
        "tokenizer": "builtin",
        "temperature": s["temperature"],
        "top_p": s["top_p"],
        "max_new_tokens": s["max_new_tokens"],
        "stop_on_eos": False,
    }
    if backend == "vllm":
        options["max_model_len"] = s["prompt_len"] + s["max_new_tokens"] + 8
    if backend == "native":
        options["max_prompt_len"] = s["prompt_len"]
        options["max_num_seqs"] = max(1, s["prompts"])
        options["kv_cache_gb"] = 1.0
    t0 = time.perf_counter()
    role.setup(
        StageContext(
            stage=f"bench-{backend}",
            replica=0,
            device=torch.device(s["device"]),
            seed=SEED,
            run_dir=run_dir / backend,
            options=options,
        )
    )
    startup = time.perf_counter() - t0
    try:
        rates, tokens, seconds = [], 0, []
        for rep in range(s["reps"] + 1):
            t = time.perf_counter()
            out, _ = role.handle("generate", dict(prompts), {"step": rep, "mb_id": 0})
            dt = time.perf_counter() - t
            tokens = int(out["response_mask"].sum())
            if rep:  # the first call warms caches up
                rates.append(tokens / dt)
                seconds.append(dt)
        concurrency = _by_concurrency(role, prompts) if backend == "native" else None
    finally:
        role.close()
    result: dict[str, Any] = {
        "tokens_per_s": round(statistics.median(rates), 1),
        "tokens_per_call": tokens,
        "call_s": round(statistics.median(seconds), 4),
        "startup_s": round(startup, 2),
    }
    if concurrency is not None:
        result["tokens_per_s_by_concurrency"] = concurrency
    return result


def _by_concurrency(role: Any, prompts: dict[str, torch.Tensor]) -> dict[str, float]:
    """The same prompts split into k micro-batches whose `generate` calls are in flight
    together (as the rollout stage runs them): tok/s for k = 1, 2, 4, 8."""
    from hybridflow.transport import aio

    generate = role.bound_op(role.op_spec("generate"))
    rows = prompts["prompt_ids"].shape[0]

    async def together(k: int) -> tuple[int, float]:
        parts = [{name: v[i::k] for name, v in prompts.items()} for i in range(k) if i < rows]
        t = time.perf_counter()
        outs = await asyncio.gather(
            *(generate(p, {"step": 100 + k, "mb_id": i}) for i, p in enumerate(parts))
        )
        return sum(int(o["response_mask"].sum()) for o, _ in outs), time.perf_counter() - t

    rates = {}
    for k in (1, 2, 4, 8):
        tokens, dt = aio.run(together(k))
        rates[str(k)] = round(tokens / dt, 1)
    return rates

"""Helpers of the native engine tests: tiny Qwen2/Llama models (random init, wider than
the default so that greedy decoding does not just repeat the prompt's last token), engine
builders, prompts, a stage context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridflow.models.loader import ModelOptions, load_model
from hybridflow.stages.base import StageContext
from hybridflow.stages.rollout.native.engine import EngineConfig, NativeEngine
from hybridflow.stages.rollout.native.kv_cache import SlotCache
from hybridflow.stages.rollout.native.request import Request

OVERRIDES = {"initializer_range": 0.3}


def build(tokenizer: Any, preset: str = "tiny", device: str = "cpu", **kw: Any) -> Any:
    opts = ModelOptions(model=preset, tokenizer="builtin", model_overrides=OVERRIDES, **kw)
    return load_model(opts, tokenizer, device=device, seed=0).requires_grad_(False)


def engine(model: Any, **kw: Any) -> NativeEngine:
    """Slots of 64 positions; decode steps attend to 16, 32 or 64 of them (length buckets
    small enough that every test's rows cross from one to the next)."""
    config = EngineConfig(
        **{"max_model_len": 64, "kv_cache_gb": 0.05, "decode_lengths": (16, 32), **kw}
    )
    return NativeEngine(model, config)


def run_all(eng: NativeEngine, requests: list[Request]) -> list[Any]:
    """Add all requests, step until done; outputs in request order."""
    ids = [eng.add_request(r) for r in requests]
    outs: dict[int, Any] = {}
    while eng.has_work():
        outs.update({o.request_id: o for o in eng.step()})
    return [outs[i] for i in ids]


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 9) -> list[torch.Tensor]:
    """n random prompts of random length in [lo, hi], ids in [2, 190)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g)
    return [torch.randint(2, 190, (int(k),), generator=g) for k in lengths]


def ctx(options: dict[str, Any], device: str = "cpu") -> StageContext:
    base = {"model": "tiny", "tokenizer": "builtin", "model_overrides": OVERRIDES}
    return StageContext(
        stage="rollout",
        replica=0,
        device=torch.device(device),
        seed=0,
        run_dir=Path("."),
        options={**base, **options},
    )


def capture(call: Any) -> tuple[Any, Any]:
    """`call()` captured in a CUDA graph -> (graph, the output tensors it writes), after
    one warm-up run (Triton compiles, allocators settle) on a side stream, off the
    capture, as the engine does."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def slot_cache(**kw: Any) -> SlotCache:
    """A small allocated CPU SlotCache with no model (tests of the cache's own books)."""
    args: dict[str, Any] = {
        "layers": 1,
        "kv_heads": 1,
        "head_dim": 4,
        "max_len": 16,
        "dtype": torch.float32,
        "device": torch.device("cpu"),
        "budget_gb": 0.01,
        "max_slots": 2,
        "stop_width": 1,
    }
    cache = SlotCache(**(args | kw))
    cache.allocate()
    return cache

"""The decode kernels asked for where they cannot run (the CPU, no Triton interpreter):
the engine keeps the torch paths, bit for bit, and its logits buffer stays float32."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from native_helpers import build, engine, prompts, run_all

from hybridflow.stages.rollout.native.forward import rope_write
from hybridflow.stages.rollout.native.request import Request, SamplingParams

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs the kernels"
)


def test_kernels_asked_for_on_the_cpu_keep_the_torch_paths(tokenizer: Any) -> None:
    model = build(tokenizer, "tiny-qwen3")
    reqs = [
        Request(prompts(3, seed=k), SamplingParams(temperature=t, max_new_tokens=10), seed=k)
        for k, t in ((1, 0.0), (2, 1.0))
    ]
    off = run_all(engine(model, rope_kernel=False, sample_kernel=False, kv_block_size=16), reqs)
    eng = engine(model, rope_kernel=True, sample_kernel=True, kv_block_size=16)
    assert eng.sampler._work is None  # no kernel work buffers: the torch sampler runs
    assert eng.sampler.logits is not None and eng.sampler.logits.dtype == torch.float32
    assert not rope_write.applies(
        torch.float32,
        model.model.rotary_emb.inv_freq,
        (None, None),
        torch.float32,
        64,
        torch.device("cpu"),
    )
    on = run_all(eng, reqs)
    for a, b in zip(off, on, strict=True):
        assert torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.logprobs, b.logprobs)

"""The fused decode path (native/forward/fused.py) on CPU: it is what the engine takes for every
supported architecture, its tokens and log-probs equal the module path's, the modules'
weights are views of its merged tensors (an in-place load reaches it, a replaced tensor
is copied back by refresh), LoRA-wrapped projections keep the module path, and its
elementwise functions compiled (inductor's CPU backend) equal them eager."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from native_helpers import build, engine, prompts, run_all

from hybridflow.stages.rollout.native.forward.fused import FusedDecode, unfusable
from hybridflow.stages.rollout.native.request import Request, SamplingParams

SAMPLED = SamplingParams(temperature=0.8, max_new_tokens=20, n=2)


def _requests() -> list[Request]:
    return [
        Request(prompts(3, seed=7), SAMPLED, seed=3),
        Request(prompts(2, seed=8), SAMPLED, seed=4),
    ]


def _same(a: list[Any], b: list[Any]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.tokens, y.tokens)
        assert torch.allclose(x.logprobs, y.logprobs, atol=1e-6)


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "tiny-qwen3", "tiny-mistral"])
def test_the_fused_path_is_taken_and_equals_the_module_path(tokenizer: Any, preset: str) -> None:
    fused = engine(build(tokenizer, preset))
    module = engine(build(tokenizer, preset), fused_decode=False)
    assert fused.fused_off is None and fused.model.fused is not None
    assert module.model.fused is None and module.fused_off == "fused_decode: false"
    _same(run_all(fused, _requests()), run_all(module, _requests()))


def test_module_weights_are_views_of_the_merged_tensors(tokenizer: Any) -> None:
    model = build(tokenizer, "tiny")
    eng = engine(model)
    fw = eng.model.fused.layers[0]
    attn = model.model.layers[0].self_attn
    before = fw.qkv_w.clone()
    with torch.no_grad():  # an in-place load (InPlaceWeights' copy_) reaches the merged weight
        attn.k_proj.weight.copy_(torch.randn_like(attn.k_proj.weight))
    rows = attn.q_proj.out_features
    assert torch.equal(fw.qkv_w[rows : rows + attn.k_proj.out_features], attn.k_proj.weight)
    assert not torch.equal(fw.qkv_w, before)
    assert eng.model.refresh_fused() == 0  # nothing replaced: nothing to copy


def test_replaced_weights_are_copied_back_and_decode_with_the_new_values(tokenizer: Any) -> None:
    """An aliased update replaces parameters' storage (param.data = the actor's tensor):
    refresh copies them into the merged tensors, and decode computes with them."""
    model, other = build(tokenizer, "tiny"), build(tokenizer, "tiny", init_seed=1)
    eng = engine(model)
    reference = engine(other, fused_decode=False)
    new = dict(other.named_parameters())
    replaced = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not torch.equal(p, new[name]):
                p.data = new[name].detach().clone()
                replaced += 1
    assert replaced > 0
    # q, k, v, gate and up weights of every layer (the q/k/v biases init to zero in both)
    assert eng.model.refresh_fused() == 5 * len(model.model.layers)
    _same(run_all(eng, _requests()), run_all(reference, _requests()))


@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft asks a deprecated transformers API
def test_lora_wrapped_projections_are_not_fusable(tokenizer: Any) -> None:
    peft = pytest.importorskip("peft")
    model = build(tokenizer, "tiny")
    cfg = peft.LoraConfig(r=2, target_modules=["q_proj", "gate_proj"])
    wrapped = peft.get_peft_model(model, cfg).base_model.model
    assert "not plain nn.Linear" in str(unfusable(wrapped))


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's own torch.jit use
def test_compiled_functions_equal_eager(tokenizer: Any) -> None:
    """torch.compile of the three elementwise functions (dynamic shapes, fullgraph): the
    CPU backend here, CUDA's on the GPU machine; the same graph breaks would fail both."""
    pytest.importorskip("torch._inductor")
    model = build(tokenizer, "tiny-qwen3")  # the per-head q/k norms: every branch
    eager = engine(model)
    out = run_all(eager, _requests())
    eager.model.fused = FusedDecode(eager.model, compile_fns=True)
    assert eager.model.fused.compiled
    again = run_all(eager, _requests())
    for x, y in zip(out, again, strict=True):
        assert torch.equal(x.tokens, y.tokens)
        assert torch.allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_a_compile_that_fails_falls_back_to_eager_with_the_reason(qwen: Any) -> None:
    """compile_decode on a machine where inductor cannot build (no C compiler for Triton):
    the engine's probe catches it, says why, and decodes eagerly. The failing compiled
    function is a stand-in at the probe's seam (CPU never compiles)."""
    eng = engine(qwen)

    def broken(*args: Any) -> Any:
        # shaped like inductor's BackendCompilerFailed: the cause on the second line
        raise RuntimeError(
            "backend='inductor' raised:\nRuntimeError: no C compiler\n\nSet TORCHDYNAMO_VERBOSE=1"
        )

    eng._uniform = broken
    eng.model.fused.compiled = True
    eng._probe_compiled()
    assert eng.compile_error == (
        "RuntimeError: backend='inductor' raised: | RuntimeError: no C compiler"
    )
    assert not eng.model.fused.compiled and eng._uniform is not broken
    _same(run_all(eng, _requests()), run_all(engine(qwen, fused_decode=False), _requests()))

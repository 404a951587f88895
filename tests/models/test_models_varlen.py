"""models/varlen.py: the packed documents' attention. On the CPU its reference (SDPA over
a block-diagonal causal mask) against each document's own causal SDPA, with grouped
query heads; on a GPU torch's varlen flash kernel against that reference, forward and
backward, in bf16 (the stage-level packed == padded checks are in
tests/stages/test_stages_packing.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybridflow.models import varlen

LENGTHS = [7, 1, 30, 64, 129, 2]  # a one-token document, and lengths either side of 64/128


def _qkv(lengths, heads, kv_heads, dim, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    t = sum(lengths)

    def rnd(h):
        return torch.randn(t, h, dim, device=device, generator=g).to(dtype)

    return rnd(heads), rnd(kv_heads), rnd(kv_heads)


def _per_document(q, k, v, lengths, scale):
    """Each document's causal SDPA on its own: what the packed attention must equal."""
    rep = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start : start + n].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale
        )
        out.append(o.transpose(0, 1))
        start += n
    return torch.cat(out)


def test_packed_kwargs_are_cumulative_lengths_and_the_longest():
    kw = varlen.packed_kwargs([3, 1, 5], torch.device("cpu"))
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 4, 9] and kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"]
    assert kw["max_length_q"] == kw["max_length_k"] == 5


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
def test_the_reference_is_each_document_attending_causally_to_itself(heads, kv_heads):
    q, k, v = _qkv(LENGTHS, heads, kv_heads, 16, "cpu", torch.float32)
    cu = varlen.packed_kwargs(LENGTHS, torch.device("cpu"))["cu_seq_lens_q"]
    got = varlen.reference(q, k, v, cu, 0.25)
    torch.testing.assert_close(got, _per_document(q, k, v, LENGTHS, 0.25), atol=1e-6, rtol=1e-5)


def test_the_attention_function_takes_transformers_layout_and_refuses_windows():
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    q, k, v = _qkv(LENGTHS, 6, 2, 16, "cpu", torch.float32)
    kw = varlen.packed_kwargs(LENGTHS, torch.device("cpu"))
    # transformers hands [1, heads, T, D] and expects [1, T, heads, D] back
    out, weights = varlen.attention(
        module, *(x.transpose(0, 1)[None] for x in (q, k, v)), None, scaling=0.25, **kw
    )
    assert weights is None and out.shape == (1, sum(LENGTHS), 6, 16)
    torch.testing.assert_close(out[0], _per_document(q, k, v, LENGTHS, 0.25), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="sliding-window"):
        varlen.attention(
            module, *(x.transpose(0, 1)[None] for x in (q, k, v)), None, sliding_window=8, **kw
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flash varlen kernel)")
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(12, 2, 128), (8, 8, 64)])
def test_the_flash_kernel_equals_the_reference_forward_and_backward(heads, kv_heads, dim):
    """qwen2-1.5b's heads (12 query, 2 key/value, 128 wide) and a plain multi-head shape."""
    assert varlen._varlen_attn is not None, "this torch has no torch.nn.attention.varlen"
    dev = torch.device("cuda")
    q, k, v = (x.requires_grad_() for x in _qkv(LENGTHS, heads, kv_heads, dim, dev, torch.bfloat16))
    cu = varlen.packed_kwargs(LENGTHS, dev)["cu_seq_lens_q"]
    scale = dim**-0.5
    got = varlen._flash(q, k, v, cu, max(LENGTHS), scale)
    g = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (q, k, v), g)
    # the reference in float32 on the same bf16 inputs
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    want = varlen.reference(q32, k32, v32, cu, scale)
    want_grads = torch.autograd.grad(want, (q32, k32, v32), g.float())
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a.float(), b, atol=3e-2, rtol=3e-2)


def test_float32_queries_under_autocast_run_in_the_autocast_dtype():
    """RoPE hands float32 queries to attention when the weights are float32 under bf16
    autocast; autocast casts SDPA's inputs but not a custom kernel's."""
    q = torch.randn(5, 2, 8)
    assert varlen._compute_dtype(q) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert varlen._compute_dtype(q) == torch.bfloat16
    assert varlen._compute_dtype(q.bfloat16()) == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flash varlen kernel)")
def test_float32_activations_under_autocast_reach_the_flash_kernel():
    module = SimpleNamespace(num_key_value_groups=6, is_causal=True)
    q, k, v = _qkv(LENGTHS, 12, 2, 128, "cuda", torch.float32)
    kw = varlen.packed_kwargs(LENGTHS, torch.device("cuda"))
    args = [x.transpose(0, 1)[None] for x in (q, k, v)]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _ = varlen.attention(module, *args, None, scaling=128**-0.5, **kw)
    assert out.dtype == torch.bfloat16  # the flash kernel's output, not the fp32 reference's
    want = _per_document(q, k, v, LENGTHS, 128**-0.5)
    torch.testing.assert_close(out[0].float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_qwen2_model_on_this_gpu_is_supported():
    from hybridflow.models.loader import ModelOptions, load_model, load_tokenizer

    opts = ModelOptions(model="qwen2-0.5b", attn_implementation="varlen")
    model = load_model(opts, load_tokenizer("builtin"), device="cuda", path="x")
    assert varlen.unsupported(model) is None

"""The decode step's Triton kernels against the torch paths they replace (GPU):
  sampling.kernel.sample_fused   = sampler.sample without truncation (tokens, log-probs,
                                   the draw's distribution), from bf16 or float32 logits;
  rope_write.qkv_rope_write      = fused.qkv_rope + cache.write (q and the cache, slot and
                                   paged strides, Qwen2 and Qwen3 heads, bf16 and float32);
and the engine with `decode_kernels` on gives the tokens it gives with them off."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from native_helpers import build, engine, prompts, run_all

from hybridflow.stages.rollout.native.forward import rope_write
from hybridflow.stages.rollout.native.forward.fused import qkv_rope
from hybridflow.stages.rollout.native.request import Request, SamplingParams
from hybridflow.stages.rollout.native.sampling.kernel import sample_fused
from hybridflow.stages.rollout.native.sampling.sampler import sample

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # the CPU build has no triton; these need a GPU
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [151936, 1000, 192])
def test_fused_sampler_equals_the_torch_sampler(dtype: torch.dtype, vocab: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(vocab)
    b = 256
    logits = (torch.randn(b, vocab, device="cuda", generator=g) * 4).to(dtype)
    temp = torch.tensor([1.0, 0.6, 0.0, 1.7], device="cuda").repeat(b // 4)
    u = torch.rand(b, device="cuda", generator=g).clamp(1e-6, 1 - 1e-6)
    off = (torch.zeros(b, dtype=torch.int64, device="cuda"), torch.ones(b, device="cuda"))
    ref_tok, ref_lp = sample(logits.float(), temp, *off, u, False)
    tok, lp = sample_fused(logits, temp, u)
    greedy = temp == 0
    assert torch.equal(tok[greedy], logits.float()[greedy].argmax(-1))
    # a u within rounding of a token boundary may take the neighbour: rare, never more
    assert (tok == ref_tok).float().mean() >= 0.99
    same = tok == ref_tok
    torch.testing.assert_close(lp[same], ref_lp[same], atol=2e-5, rtol=1e-5)
    # every log-prob is the token's under softmax(logits / T) (T = 1 for greedy rows)
    t = torch.where(greedy, 1.0, temp)[:, None]
    exact = torch.log_softmax(logits.double() / t, -1).gather(-1, tok[:, None]).squeeze(-1)
    torch.testing.assert_close(lp.double(), exact, atol=5e-5, rtol=1e-5)


def test_fused_sampler_draws_from_the_softmax() -> None:
    """20,000 rows of one 6-token distribution at T = 0.8: frequencies within 5 sigma."""
    n = 20000
    base = torch.tensor([2.0, 0.5, -1.0, 1.5, 0.0, -3.0], device="cuda")
    logits = base.repeat(n, 1).to(torch.bfloat16)
    temp = torch.full((n,), 0.8, device="cuda")
    u = torch.rand(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    tok, _ = sample_fused(logits, temp, u)
    p = torch.softmax(logits.float()[0] / 0.8, -1)
    freq = torch.bincount(tok, minlength=6).float() / n
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-4).all(), (freq, p)


def _tables(length: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    emb = torch.outer(torch.arange(length, device="cuda").float(), inv)
    emb = torch.cat([emb, emb], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("hq", "hkv", "d", "norms"), [(14, 2, 64, False), (16, 8, 128, True)])
@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_rope_write_equals_qkv_rope_and_the_index_writes(
    dtype: torch.dtype, hq: int, hkv: int, d: int, norms: bool, layout: str
) -> None:
    g = torch.Generator(device="cuda").manual_seed(hq + d)
    b, length = 48, 300
    qkv = torch.randn(b, (hq + 2 * hkv) * d, device="cuda", generator=g).to(dtype)
    cos, sin = _tables(length, d, dtype)
    pos = torch.randint(0, length, (b,), device="cuda", generator=g)
    qn = kn = None
    if norms:
        qn = (torch.rand(d, device="cuda", generator=g) + 0.5).to(dtype)
        kn = (torch.rand(d, device="cuda", generator=g) + 0.5).to(dtype)
    # slots: [S, Hkv, L, D] addressed (row, position); paged: [NB, Hkv, 16, D] (block, offset)
    shape = (b, hkv, length, d) if layout == "slots" else (4 * b, hkv, 16, d)
    kv = torch.randn(2, 3, *shape, device="cuda", generator=g).to(dtype)[:, 1]  # strided
    if layout == "slots":
        at = (torch.arange(b, device="cuda"), pos)
    else:
        at = (torch.randperm(4 * b, device="cuda", generator=g)[:b], pos % 16)
    ref = kv.clone()
    q, k, v = qkv_rope(qkv, cos[pos], sin[pos], qn, kn, 1e-6, hkv, d, dtype)
    ref[0][at[0], :, at[1]] = k
    ref[1][at[0], :, at[1]] = v
    assert rope_write.applies(dtype, cos, (qn, kn), kv.dtype, d, qkv.device)
    got = rope_write.qkv_rope_write(qkv, cos, sin, pos, qn, kn, 1e-6, kv[0], kv[1], at)
    if dtype == torch.bfloat16 and not norms:  # every op rounded as eager's: bit for bit
        assert torch.equal(got, q)
        assert torch.equal(kv, ref)
    else:
        # float32: the compiler may contract a product and a sum into one FMA (one rounding
        # fewer, as inductor's kernels do); the norm's mean sums in another order
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got, q, atol=tol, rtol=0)
        torch.testing.assert_close(kv, ref, atol=tol, rtol=0)
        assert (got == q).float().mean() > 0.5


def test_rope_write_does_not_apply_across_dtypes() -> None:
    cos, _ = _tables(8, 64, torch.float32)
    cache = torch.zeros(2, 2, 8, 64, dtype=torch.bfloat16, device="cuda")
    assert not rope_write.applies(torch.bfloat16, cos, (None, None), cache.dtype, 64, cache.device)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
@pytest.mark.parametrize("kv_block_size", [0, 16])
def test_engine_with_decode_kernels_gives_the_torch_paths_tokens(
    tokenizer: Any, preset: str, kv_block_size: int
) -> None:
    """Greedy and sampled requests through CUDA graphs, kernels on against off: float32
    exactly (tokens, log-probs close), bfloat16 greedy all but at most one request."""
    for dtype in (None, "bfloat16"):
        model = build(
            tokenizer, preset, device="cuda", **({} if dtype is None else {"dtype": dtype})
        )
        reqs = [
            Request(
                [p.cuda() for p in prompts(4, seed=k, lo=3, hi=20)],
                SamplingParams(temperature=t, max_new_tokens=32),
                seed=k,
            )
            for k, t in ((1, 0.0), (2, 1.0), (3, 0.7))
        ]
        kw: dict[str, Any] = {"max_num_seqs": 16, "graph_batch_sizes": (4, 8, 16)}
        kw["kv_block_size"] = kv_block_size
        off = run_all(engine(model, rope_kernel=False, sample_kernel=False, **kw), reqs)
        eng = engine(model, rope_kernel=True, sample_kernel=True, **kw)
        assert eng.sampler._work is not None
        assert eng.sampler.logits is not None
        if dtype == "bfloat16":
            assert eng.sampler.logits.dtype == torch.bfloat16  # no float32 copy of the head
        on = run_all(eng, reqs)
        same = [torch.equal(a.tokens, b.tokens) for a, b in zip(off, on, strict=True)]
        if dtype is None:
            assert all(same)
            for a, b in zip(off, on, strict=True):
                torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=1e-4)
        else:
            assert sum(same) >= len(same) - 1

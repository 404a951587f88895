"""models/head_kernel.py's Triton passes against head_logprobs' torch passes (GPU): the
per-chunk statistics and the closed-form gradient, then whole `head_logprobs` and a
model's `response_logprobs` with `kernel` on and off."""

from __future__ import annotations

import pytest
import torch

from hybridflow.models import head_kernel
from hybridflow.models.head_logprobs import _chunk_stats, _grad, _scaled, head_logprobs
from hybridflow.models.loader import ModelOptions, load_model, load_tokenizer
from hybridflow.stages.common import response_logprobs

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # the CPU build has no triton; these need a GPU
    pytest.skip("needs CUDA", allow_module_level=True)


def _logits(n: int, v: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, v, device="cuda", generator=g) * 4
    x[0, 3] = 40.0  # a dominant token: small entropy, large logits (no cancellation)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [151936, 50])  # a vocabulary under one block too
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_stats_and_grad_equal_the_torch_passes(dtype, vocab, temperature):
    n = 67
    logits = _logits(n, vocab, dtype, vocab)
    y = torch.randint(0, vocab, (n,), device="cuda")
    lp, lse, ent = head_kernel.stats(logits, y, temperature, True)
    lp0, lse0, ent0 = _chunk_stats(_scaled(logits, temperature), y, True)
    assert ent is not None and ent0 is not None
    for got, want in ((lp, lp0), (lse, lse0), (ent, ent0)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-6)
    assert head_kernel.stats(logits, y, temperature, False)[2] is None
    g = torch.randn(2, n, device="cuda")
    for g_lp, g_ent in ((g[0], g[1]), (g[0], None), (None, g[1])):
        gz = head_kernel.grad(logits, y, lse0, ent0, g_lp, g_ent, temperature)
        gz0 = _grad(logits, y, lse0, ent0, g_lp, g_ent, temperature)
        assert gz.dtype == logits.dtype and gz.shape == logits.shape
        # float32: exp differs in the last bits (1e-5 where p ~ 1 cancels); bf16: an ulp
        tol = (
            {"atol": 1e-5, "rtol": 1e-5}
            if dtype == torch.float32
            else {"atol": 1e-5, "rtol": 1.6e-2}
        )
        torch.testing.assert_close(gz.float(), gz0.float(), **tol)


def test_a_minus_inf_logit_has_no_mass():
    logits = _logits(4, 1000, torch.float32, 0)
    logits[:, 10:20] = float("-inf")
    y = torch.zeros(4, dtype=torch.int64, device="cuda")
    lp, lse, ent = head_kernel.stats(logits, y, 1.0, True)
    finite = logits[:, torch.isfinite(logits[0])]
    torch.testing.assert_close(lse, torch.logsumexp(finite, -1))
    torch.testing.assert_close(lp, finite[:, 0] - lse)
    p = finite.softmax(-1)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1))
    gz = head_kernel.grad(logits, y, lse, ent, torch.ones(4, device="cuda"), None, 1.0)
    assert bool((gz[:, 10:20] == 0).all())


@pytest.mark.parametrize("autocast", [False, True])
def test_head_logprobs_with_the_kernel_equal_without(autocast):
    g = torch.Generator(device="cuda").manual_seed(1)
    n, h, v = 300, 64, 151936
    head = torch.nn.Linear(h, v, device="cuda")
    hidden = torch.randn(n, h, device="cuda", generator=g, requires_grad=True)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    up = torch.randn(2, n, device="cuda", generator=g)
    got = []
    for kernel in (True, False):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            lp, ent = head_logprobs(
                hidden,
                y,
                head,
                temperature=0.9,
                chunk_tokens=128,
                with_entropy=True,
                kernel=kernel,
            )
        assert ent is not None
        grads = torch.autograd.grad((up[0] * lp + up[1] * ent).sum(), [hidden, *head.parameters()])
        got.append((lp, ent, *grads))
    tol = {"atol": 5e-3, "rtol": 2e-2} if autocast else {"atol": 1e-5, "rtol": 1e-4}
    for a, b in zip(*got, strict=True):
        torch.testing.assert_close(a, b, **tol)


def test_a_models_response_logprobs_with_the_kernel_equal_without():
    tok = load_tokenizer("builtin")
    cuda = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    batch = {
        "prompt_ids": torch.randint(2, 150, (4, 6), generator=g),
        "prompt_mask": torch.ones(4, 6, dtype=torch.int64),
        "response_ids": torch.randint(2, 150, (4, 9), generator=g),
        "response_mask": torch.ones(4, 9, dtype=torch.int64),
    }
    batch["response_mask"][0, 5:] = 0
    out = []
    for kernel in (True, False):
        torch.manual_seed(0)
        model = load_model(ModelOptions(model="tiny", tokenizer="builtin"), tok).to(cuda).train()
        lp, ent = response_logprobs(
            model,
            batch,
            cuda,
            0.8,
            with_entropy=True,
            entropy_grad=True,
            chunk_tokens=7,
            kernel=kernel,
        )
        assert lp is not None and ent is not None
        (lp.sum() * 0.3 + ent.sum() * 0.1).backward()
        out.append([lp.detach(), ent.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*out, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_probes_accept_the_kernels_on_this_gpu():
    """The probes that guard the default-on kernels (kernels.builds, head_kernel.usable)
    must not turn them off where they work: a wrong rejection would only warn and run
    slower."""
    from hybridflow.models import kernels

    assert kernels.runs_on(torch.device("cuda"))  # the build probe (models/kernels.py)
    head_kernel.usable.answers.pop("cuda", None)
    assert head_kernel._probe(torch.device("cuda")) is None
    assert head_kernel.usable(torch.device("cuda"))

"""Log-probs and entropy through the head in chunks of tokens (models/head_logprobs.py)
equal the full [N, V] computation: values, gradients w.r.t. hidden states and head
parameters, under temperature, bias, autocast and the fp32 head, inside a model's forward."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algos.losses import entropy_from_logits, logprobs_from_logits
from hybridflow.models.head_logprobs import chunkable, head_logprobs, model_head_logprobs
from hybridflow.models.heads import FP32Linear
from hybridflow.models.loader import ModelOptions, load_model, load_tokenizer
from hybridflow.stages.common import response_logprobs

N, H, V = 37, 16, 50
CHUNKS = [1, 5, 8, 36, 37, 100]  # 5, 8, 36 do not divide N = 37


def _case(bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
        if bias:
            head.bias.copy_(torch.randn(V, generator=g))
    hidden = torch.randn(N, H, generator=g).requires_grad_(True)
    targets = torch.randint(0, V, (N,), generator=g)
    upstream = torch.randn(2, N, generator=g)  # dL/dlogp, dL/dH
    return head, hidden, targets, upstream


def _full(head, hidden, targets, temperature):
    logits = head(hidden) / temperature
    lp = logprobs_from_logits(logits[None], targets[None])[0]
    return lp, entropy_from_logits(logits)


def _grads(loss, head, hidden):
    return torch.autograd.grad(loss, [hidden, *head.parameters()])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_values_and_gradients_equal_the_full_computation(chunk, temperature):
    head, hidden, targets, up = _case()
    lp0, ent0 = _full(head, hidden, targets, temperature)
    want = _grads((up[0] * lp0 + up[1] * ent0).sum(), head, hidden)
    lp, ent = head_logprobs(
        hidden, targets, head, temperature=temperature, chunk_tokens=chunk, with_entropy=True
    )
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (N,)
    torch.testing.assert_close(lp, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent0, atol=1e-5, rtol=0)
    got = _grads((up[0] * lp + up[1] * ent).sum(), head, hidden)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [3, 37])
def test_log_probs_alone_and_entropy_without_grad(chunk):
    """Only the log-prob in the loss (entropy_coef 0): its gradient alone; entropy asked
    for but detached is the same number with no graph."""
    head, hidden, targets, up = _case(bias=False)
    lp0, ent0 = _full(head, hidden, targets, 1.0)
    want = _grads((up[0] * lp0).sum(), head, hidden)
    lp, ent = head_logprobs(hidden, targets, head, chunk_tokens=chunk, with_entropy=True)
    got = _grads((up[0] * lp).sum(), head, hidden)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent0, atol=1e-5, rtol=0)
    lp_only, none = head_logprobs(hidden, targets, head, chunk_tokens=chunk)
    assert none is None
    torch.testing.assert_close(lp_only, lp0, atol=1e-5, rtol=0)


def test_no_chunk_of_logits_is_larger_than_the_chunk():
    head, hidden, targets, up = _case()
    rows: list[int] = []

    def counting(x: torch.Tensor) -> torch.Tensor:
        rows.append(x.shape[0])
        return head(x)

    lp, ent = head_logprobs(
        hidden,
        targets,
        counting,
        params=list(head.parameters()),
        chunk_tokens=8,
        with_entropy=True,
    )
    (up[0] * lp + up[1] * ent).sum().backward()
    assert rows == [8, 8, 8, 8, 5] * 2  # forward, then backward recomputes each chunk
    assert hidden.grad is not None and head.weight.grad is not None


def test_under_bf16_autocast_and_with_the_fp32_head():
    """Forward under autocast (backward outside it, as the trainer runs it): the plain head
    rounds to bf16 (chunked and full then differ by bf16 rounding), the fp32 head does not."""
    head, hidden, targets, up = _case()
    fp32 = FP32Linear(H, V)
    fp32.load_state_dict(head.state_dict())
    for module, atol in ((head, 0.1), (fp32, 1e-5)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp0, ent0 = _full(module, hidden, targets, 0.7)
            lp, ent = head_logprobs(
                hidden, targets, module, temperature=0.7, chunk_tokens=6, with_entropy=True
            )
        want = _grads((up[0] * lp0 + up[1] * ent0).sum(), module, hidden)
        got = _grads((up[0] * lp + up[1] * ent).sum(), module, hidden)
        torch.testing.assert_close(lp, lp0, atol=atol, rtol=0)
        torch.testing.assert_close(ent, ent0, atol=atol, rtol=0)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, atol=atol, rtol=atol)


def test_no_tokens():
    head, hidden, targets, _ = _case()
    lp, ent = head_logprobs(hidden[:0], targets[:0], head, chunk_tokens=4, with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert lp.shape == (0,) and bool((head.weight.grad == 0).all())


def test_bad_arguments():
    head, hidden, targets, _ = _case()
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        head_logprobs(hidden, targets, head, chunk_tokens=0)
    with pytest.raises(ValueError, match=r"hidden must be \[N, H\]"):
        head_logprobs(hidden[None], targets, head)


# -- inside a model's forward ---------------------------------------------------------
TOK = load_tokenizer("builtin")


def _model(**opts: object) -> torch.nn.Module:
    model = load_model(ModelOptions(model="tiny", tokenizer="builtin", **opts), TOK)
    return model.train()


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, p, r = 4, 6, 9
    prompt_mask = torch.ones(b, p, dtype=torch.int64)
    prompt_mask[1, :2] = 0  # left padding
    response_mask = torch.ones(b, r, dtype=torch.int64)
    response_mask[0, 5:] = 0  # right padding
    response_mask[2, 3:5] = 0  # a multi-turn observation inside the response
    return {
        "prompt_ids": torch.randint(2, 150, (b, p), generator=g),
        "prompt_mask": prompt_mask,
        "response_ids": torch.randint(2, 150, (b, r), generator=g),
        "response_mask": response_mask,
    }


@pytest.mark.parametrize("opts", [{}, {"fp32_lm_head": True}], ids=["plain", "fp32_head"])
@pytest.mark.parametrize("chunk", [1, 7, 1024])
def test_response_logprobs_chunked_equal_full_with_all_gradients(chunk, opts):
    batch, cpu = _batch(), torch.device("cpu")
    grads = []
    results = []
    for c in (0, chunk):
        model = _model(**opts)
        lp, ent = response_logprobs(
            model, batch, cpu, 0.8, with_entropy=True, entropy_grad=True, chunk_tokens=c
        )
        (lp.sum() * 0.3 + ent.sum() * 0.1).backward()
        results.append((lp.detach(), ent.detach()))
        grads.append({n: p.grad for n, p in model.named_parameters()})
    (lp0, ent0), (lp1, ent1) = results
    assert bool((lp1[batch["response_mask"] == 0] == 0).all())
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=0)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_the_head_computes_only_the_response_tokens_and_is_restored():
    model, batch = _model(), _batch()
    seen: list[tuple[int, ...]] = []

    class Counting(torch.nn.Linear):  # the head's own forward: what gets logits
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(tuple(x.shape))
            return super().forward(x)

    head = Counting(64, len(TOK), bias=False)
    head.weight = model.lm_head.weight
    model.lm_head = head
    with torch.no_grad():
        response_logprobs(model, batch, torch.device("cpu"), chunk_tokens=16)
    n = int(batch["response_mask"].sum())  # 30 valid response tokens, of 4 x 9
    assert seen == [(16, 64), (n - 16, 64)]
    assert "forward" not in head.__dict__  # the class's forward again
    seen.clear()
    with torch.no_grad():
        assert model(input_ids=batch["prompt_ids"]).logits.shape[-1] == len(TOK)
    assert seen == [(4, 6, 64)]


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # peft's, moot here
def test_lora_on_the_head_trains_its_adapters_alike():
    pytest.importorskip("peft")
    from hybridflow.models.lora import LoraOptions, wrap

    batch, cpu = _batch(), torch.device("cpu")
    grads = []
    for c in (0, 5):
        model = _model()
        opts = LoraOptions(lora_rank=4, lora_target_modules=["q_proj", "lm_head"])
        wrap(model, opts, kind="causal_lm", seed=0, path="actor")
        with torch.no_grad():  # B starts at zero: make the adapters count
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        lp, _ = response_logprobs(model, batch, cpu, chunk_tokens=c)
        lp.sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert any("lm_head" in n for n in grads[0])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_a_model_that_transforms_its_logits_falls_back_or_is_refused():
    model, batch = _model(), _batch()
    model.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping" in (chunkable(model) or "")
    with torch.no_grad():  # response_logprobs falls back to the full logits
        lp, _ = response_logprobs(model, batch, torch.device("cpu"), chunk_tokens=4)
    assert lp.shape == batch["response_ids"].shape
    model.config.final_logit_softcapping = None

    class Scaled(torch.nn.Module):  # a forward that changes the head's output
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

        def forward(self, **kw):
            out = self.inner(**kw)
            out.logits = out.logits * 2
            return out

    with pytest.raises(Exception, match="logprob_chunk_tokens"):
        model_head_logprobs(
            Scaled(model),
            {"input_ids": batch["prompt_ids"]},
            lambda h: h[:, -1],
            torch.zeros(4, dtype=torch.int64),
        )


def test_asking_for_the_kernel_on_the_cpu_changes_nothing():
    """`kernel` (the roles' logprob_kernel) takes the Triton passes only on a GPU: on the
    CPU both settings run the torch passes, bit for bit."""
    head, hidden, targets, up = _case()
    got = []
    for kernel in (True, False):
        lp, ent = head_logprobs(
            hidden,
            targets,
            head,
            temperature=0.7,
            chunk_tokens=5,
            with_entropy=True,
            kernel=kernel,
        )
        got.append((lp, ent, *_grads((up[0] * lp + up[1] * ent).sum(), head, hidden)))
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)


def _kernel_run(monkeypatch, stats, grad=None):
    """head_logprobs with `kernel` on, the kernels' seam replaced by stand-ins on the CPU
    (the CPU build has no Triton): runs_on says yes, the probe starts afresh. Returns the
    outputs, their gradients, and the torch passes' for comparison."""
    from hybridflow.models import head_kernel

    monkeypatch.setattr(head_kernel, "runs_on", lambda device: True)
    monkeypatch.setattr(head_kernel.usable, "answers", {})
    monkeypatch.setattr(head_kernel, "stats", stats)
    if grad is not None:
        monkeypatch.setattr(head_kernel, "grad", grad)
    head, hidden, targets, up = _case()
    got = []
    for kernel in (True, False):
        lp, ent = head_logprobs(
            hidden, targets, head, temperature=0.7, chunk_tokens=5, with_entropy=True, kernel=kernel
        )
        got.append((lp, ent, *_grads((up[0] * lp + up[1] * ent).sum(), head, hidden)))
    return got


def test_a_head_kernel_that_cannot_build_falls_back_to_the_torch_passes_naming_why(
    monkeypatch, caplog
):
    """logprob_kernel is on by default: where Triton cannot build (here a stand-in raising
    as Triton does without a C compiler), one probe finds it, a warning names the option
    and the cause, and every chunk runs the torch passes, bit for bit."""
    calls = []

    def no_compiler(*args):
        calls.append(args)
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    with caplog.at_level("WARNING", logger="hybridflow.models.head_kernel"):
        with_kernel, without = _kernel_run(monkeypatch, no_compiler)
    for a, b in zip(with_kernel, without, strict=True):
        assert torch.equal(a, b)
    assert len(calls) == 1  # probed once, not once per chunk (8 chunks here)
    (record,) = caplog.records
    assert "logprob_kernel" in record.message and "Failed to find C compiler" in record.message


def test_a_head_kernel_whose_numbers_are_wrong_is_never_used(monkeypatch, caplog):
    """A kernel that builds but disagrees with torch on the probe chunk is not trusted."""
    from hybridflow.models.head_logprobs import _chunk_stats, _grad, _scaled

    calls = []

    def off_by_a_bit(logits, targets, temperature, with_entropy):
        calls.append(1)
        lp, lse, ent = _chunk_stats(_scaled(logits, temperature).clone(), targets, with_entropy)
        return lp + 1e-2, lse, ent

    with caplog.at_level("WARNING", logger="hybridflow.models.head_kernel"):
        with_kernel, without = _kernel_run(monkeypatch, off_by_a_bit, _grad)
    for a, b in zip(with_kernel, without, strict=True):
        assert torch.equal(a, b)
    assert len(calls) == 1
    assert "log-probs differ" in caplog.records[0].message


def test_a_head_kernel_that_agrees_on_the_probe_takes_every_chunk(monkeypatch, caplog):
    """The probe does not reject a kernel that works: stand-ins that compute the torch
    passes' numbers (so the outputs must stay equal) pass it and then see every chunk."""
    from hybridflow.models.head_logprobs import _chunk_stats, _grad, _scaled

    stats_calls, grad_calls = [], []

    def stats(logits, targets, temperature, with_entropy):
        stats_calls.append(1)
        # clone: the torch pass consumes float32 logits at T = 1; the kernel reads only
        return _chunk_stats(_scaled(logits, temperature).clone(), targets, with_entropy)

    def grad(*args):
        grad_calls.append(1)
        return _grad(*args)

    with caplog.at_level("WARNING", logger="hybridflow.models.head_kernel"):
        with_kernel, without = _kernel_run(monkeypatch, stats, grad)
    for a, b in zip(with_kernel, without, strict=True):
        torch.testing.assert_close(a, b)
    chunks = -(-N // 5)
    assert len(stats_calls) == 1 + chunks and len(grad_calls) == 1 + chunks
    assert not caplog.records

"""The chunked head log-prob's passes over a chunk's logits (head_logprobs.py) as one
Triton kernel each way.

    stats(logits [n, V], targets [n], T, entropy) -> log p(target) [n], log-sum-exp [n],
                                                     entropy [n] | None      (float32)
    grad(logits [n, V], targets, lse, ent, g_lp, g_ent, T) -> dL/dlogits [n, V]
                                                     (the logits' dtype)

head_logprobs.py's torch path upcasts each chunk's [c, V] head output to float32 and
makes about five more passes over it in forward (logsumexp alone is max, subtract, exp,
sum) and eight in backward (upcast, subtract, exp, the entropy terms, the scatter, the
cast back). At Qwen2's 151,936-token vocabulary one float32 pass over a 1,024-token chunk
is 622 MB, so an actor update of ~20k response tokens moves ~230 GB through those passes.
Here forward reads the head's output once (bfloat16 under autocast, 311 MB a chunk) and
backward reads it once and writes the gradient once, in the head's dtype.

Forward, one program per row, an online softmax over blocks of the row: the running max
m, s = sum exp(z - m) and a = sum exp(z - m) (z - m), rescaled when m grows. Then
lse = m + log s and the entropy is log s - a / s (H = lse - E_p[z], written around m so
that large logits do not cancel). Backward is head_logprobs' closed form,

    dL/dz = -p (g_lp + g_ent (log p + H)) + g_lp onehot(y),   z = logits / T,

divided by T, rounded once to the logits' dtype as the torch path rounds it.

Numbers are the torch path's up to float32 rounding (the order of the sums and exp's
implementation differ); tests compare the two. A logit of -inf has p = 0 and adds
nothing (the torch path's entropy is NaN there). Shapes are free; one launch per chunk,
no host sync.
"""

from __future__ import annotations

import logging

import torch

from hybridflow.models.kernels import TRITON, Probe, failure, runs_on

log = logging.getLogger(__name__)

if TRITON:
    import triton
    import triton.language as tl

_BLOCK = 4096  # vocabulary entries per loop iteration of a row's program
_WARPS = 8


def applies(logits: torch.Tensor) -> bool:
    """True where the kernels take this chunk: a CUDA tensor (Triton present) whose rows
    are contiguous, on a device where the kernels were seen to build and agree (usable)."""
    return (
        runs_on(logits.device)
        and logits.dim() == 2
        and logits.stride(-1) == 1
        and usable(logits.device)
    )


def _probe(device: torch.device) -> str | None:
    """None if stats and grad run on a [2, 40] chunk and agree with torch's log-softmax
    and its gradient; else what went wrong."""
    try:
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            z = (torch.randn(2, 40, generator=g) * 3).to(device)
            y = torch.tensor([1, 7], device=device)
            rows = torch.arange(2, device=device)
            ref = torch.log_softmax(z, dim=-1)
            want_dz = -ref.exp()  # d log p(y) / dz = onehot(y) - p
            want_dz[rows, y] += 1.0
            lp, lse, ent = stats(z, y, 1.0, True)
            assert ent is not None
            if not torch.allclose(lp, ref[rows, y], atol=1e-4):
                return "its log-probs differ from torch's on a probe chunk"
            dz = grad(z, y, lse, ent, torch.ones_like(lp), None, 1.0)
            if not torch.allclose(dz, want_dz, atol=1e-4):
                return "its gradient differs from torch's on a probe chunk"
    except Exception as e:  # any build or launch failure: reported by usable
        return failure(e)
    return None


# `logprob_kernel` is on by default, so a machine where these kernels do not build (an
# unsupported GPU, beyond kernels.builds' trivial one) or build wrong must not fail the
# first training step: the probe logs why, naming the option, and the torch passes run,
# as with `logprob_kernel: false`.
usable = Probe(
    _probe,
    "logprob_kernel: the head kernel cannot run on %s (%s); the torch passes run instead "
    "(set logprob_kernel: false to silence this)",
    log,
)
"""Whether both kernels build and give the torch passes' numbers on a device's type:
probed once on a tiny chunk, the first time a chunk could take them."""


def stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[n, V] logits (any float dtype), [n] targets -> float32 log p(target) [n],
    log-sum-exp [n] and, `with_entropy`, the entropy [n], of softmax(logits / T)."""
    n, v = logits.shape
    lp = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(lp)
    ent = torch.empty_like(lp) if with_entropy else lp  # unwritten when not asked for
    if n:
        _stats_kernel[(n,)](
            logits,
            logits.stride(0),
            targets.contiguous(),
            lp,
            lse,
            ent,
            v,
            float(temperature),
            ENTROPY=with_entropy,
            BLOCK=_BLOCK,
            num_warps=_WARPS,
        )
    return lp, lse, (ent if with_entropy else None)


def grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """The gradient w.r.t. `logits` [n, V] (in their dtype) of sum(g_lp * log p(target) +
    g_ent * entropy), given forward's `lse` and `ent` (module docstring)."""
    assert g_lp is not None or g_ent is not None
    n, v = logits.shape
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if n:
        none = lse  # a placeholder pointer for an absent gradient (never read)
        _grad_kernel[(n,)](
            logits,
            logits.stride(0),
            out,
            targets.contiguous(),
            lse.contiguous(),
            ent.contiguous(),
            none if g_lp is None else g_lp.float().contiguous(),
            none if g_ent is None else g_ent.float().contiguous(),
            v,
            float(temperature),
            HAS_LP=g_lp is not None,
            HAS_ENT=g_ent is not None,
            BLOCK=_BLOCK,
            num_warps=_WARPS,
        )
    return out


if TRITON:

    @triton.jit
    def _stats_kernel(
        logits,  # [n, V]
        stride,
        targets,  # [n] int64
        lp_out,  # [n] float32
        lse_out,
        ent_out,
        V,
        t,  # temperature (> 0)
        ENTROPY: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        # -1e30, not -inf: a rescale of the first block's sums (0 * (m - m')) stays finite
        m = tl.full((), -1e30, tl.float32)
        s = tl.zeros((), tl.float32)
        a = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / t
            m_new = tl.maximum(m, tl.max(z, axis=0))
            scale = tl.exp(m - m_new)
            e = tl.exp(z - m_new)  # 0 at -inf logits and past V
            if ENTROPY:
                a = scale * (a + s * (m - m_new)) + tl.sum(
                    tl.where(e > 0.0, e * (z - m_new), 0.0), axis=0
                )
            s = s * scale + tl.sum(e, axis=0)
            m = m_new
        log_s = tl.log(s)
        lse = m + log_s
        y = tl.load(targets + row)
        zy = tl.load(base + y).to(tl.float32) / t
        tl.store(lp_out + row, zy - lse)
        tl.store(lse_out + row, lse)
        if ENTROPY:
            tl.store(ent_out + row, log_s - a / s)

    @triton.jit
    def _grad_kernel(
        logits,  # [n, V]
        stride,
        out,  # [n, V] contiguous, the logits' dtype
        targets,
        lse_in,
        ent_in,
        g_lp,  # [n] float32 (HAS_LP)
        g_ent,  # [n] float32 (HAS_ENT)
        V,
        t,
        HAS_LP: tl.constexpr,
        HAS_ENT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        lse = tl.load(lse_in + row)
        y = tl.load(targets + row)
        glp = 0.0
        if HAS_LP:
            glp = tl.load(g_lp + row)
        if HAS_ENT:
            h = tl.load(ent_in + row)
            gent = tl.load(g_ent + row)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            live = cols < V
            logp = tl.load(base + cols, mask=live, other=0.0).to(tl.float32) / t - lse
            p = tl.exp(logp)
            if HAS_ENT:  # noqa: SIM108 (a constexpr branch: one is compiled)
                gz = -(((logp + h) * gent + glp) * p)
            else:
                gz = p * -glp
            if HAS_LP:
                gz = tl.where(cols == y, gz + glp, gz)
            gz = gz / t
            tl.store(out + row * V + cols, gz.to(out.dtype.element_ty), mask=live)

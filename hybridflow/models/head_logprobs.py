"""Token log-probs and entropy through the output head, a chunk of tokens at a time.

    head_logprobs(hidden [N, H], targets [N], head)  -> logprobs [N] float32,
                                                        entropy  [N] float32 | None
    model_head_logprobs(model, select, targets, ...) -> the same, from a model call whose
                                                        head only ever sees [N, H]

`hidden` are the final hidden states of the N positions that predict a token (chosen
BEFORE the head: prompt and padding positions never get logits). The logits of at most
`chunk_tokens` of them exist at any time, [chunk, V], float32 for the log-sum-exp; a
[N, V] tensor never does. With Qwen2's 151,936-token vocabulary that is 0.6 MB per token,
so a 1,024-token chunk holds 622 MB where the full path held N x 0.6 MB several times over
(the head's output, its float32 upcast, and autograd's saved copies).

Backward (`_ChunkedHeadLogprobs`, an autograd.Function rather than a torch.utils.checkpoint
per chunk): it saves only hidden, targets and two floats per token (log-sum-exp and
entropy). Backward recomputes one chunk's logits through the head, forms their gradient in
closed form,

    d logp(y)/dz = onehot(y) - p          dH/dz = -p * (log p + H)     (z = logits / T)

and pulls it through the head with `torch.autograd.grad`. A checkpoint per chunk would
replay log-sum-exp, log-softmax and the entropy product under autograd, keeping each
one's [chunk, V] saved tensors: more memory and more passes over the chunk for the same
numbers. The head's trainable parameters are inputs of the Function, so their gradients
reach the autograd engine like any other (FSDP2's hooks, tied embeddings and LoRA
adapters on the head see ordinary accumulation). Their cost: each chunk's parameter
gradient is summed into the previous ones, so with more than one chunk a second
parameter-sized buffer lives while backward runs (545 MB for Qwen2-0.5B's float32 head,
against N x 0.6 MB per [N, V] float32 copy saved). Recomputing the chunk's logits costs
one more head matmul per token (4 head matmuls instead of 3): the gradient of the
log-probs is only known in backward (PPO's ratio, the KL term), so unlike a fused
cross-entropy it cannot be formed in forward.

The head is called as a function on each chunk (the module's own forward: an
`FP32Linear` leaves autocast, a peft-wrapped head adds its adapters, a bias is added), in
the autocast state of the forward, again in backward. Temperature divides float32 logits
(the full path divided the head's dtype, then upcast: the same numbers in float32, a
smaller rounding under bf16).

`model_head_logprobs` puts this inside a transformers causal LM's own forward: for the
length of one call the head's `forward` is replaced by one that selects the predicting
positions and returns [N, 2] (log-prob, entropy) in place of logits. The body, its
autocast wrapper (models/loader.py) and FSDP2's root hooks (the head is in the root's
unit: stages/parallel/fsdp.py) run unchanged, and the result leaves the model as its
`logits`. A model that transforms logits after its head (a softcap, a logit scale) is
refused: its result would not be the head's (`out.logits is` the returned tensor is
checked).

With `kernel` (the roles' `logprob_kernel`) and a CUDA chunk, each chunk's statistics and
its closed-form gradient come from head_kernel.py's two Triton kernels, one pass over the
head's output each, instead of `_chunk_stats` and `_grad`; everything around them (the
chunks, the recomputed head, `torch.autograd.grad`) is the same code.

Invariants: equal to the full [N, V] computation within float32 rounding (tests compare
values and gradients w.r.t. hidden states and head parameters for chunk sizes that do and
do not divide N); `chunk_tokens` bounds every [*, V] temporary of forward and backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.errors import ConfigError
from hybridflow.models import head_kernel

# 1,024 tokens: 622 MB of float32 logits per chunk at 151,936 tokens of vocabulary (a
# GPU matmul of [1024, H] x [H, V] is already large enough to run at full rate).
DEFAULT_CHUNK_TOKENS = 1024

HeadFn = Callable[[torch.Tensor], torch.Tensor]  # [n, H] -> logits [n, V]


@dataclass
class LogprobOptions:
    """How a role computes token log-probs through its output head (actor, reference)."""

    # Tokens whose logits exist at once in log-prob/entropy forward and backward (the
    # [tokens, vocab] float32 logits are never built whole); 0: the former full path
    logprob_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # On a GPU, each chunk's log-softmax, entropy and their gradient in one Triton pass
    # over the head's output (models/head_kernel.py) instead of ~13 float32 passes. On an
    # H100 (bench/RESULTS.md, session 18), a packed qwen2-1.5b update took 0.668 s with it
    # against 0.961 s without in one sitting, and 0.653 against 0.952 with 4096-token
    # chunks. The CPU always runs the torch passes; false: them on a GPU too (the
    # reference the GPU tests compare against). A GPU where the kernel does not build, or
    # disagrees with torch on a probe chunk, warns once and runs the torch passes
    logprob_kernel: bool = True

    def validate_logprob(self, path: str) -> None:
        if self.logprob_chunk_tokens < 0:
            raise ConfigError(
                f"{path}.logprob_chunk_tokens" if path else "logprob_chunk_tokens",
                f"must be >= 0 (0: the unchunked path), got {self.logprob_chunk_tokens}",
            )


def _spans(n: int, size: int) -> Iterator[slice]:
    for i in range(0, n, size):
        yield slice(i, min(i + size, n))


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Head output -> float32 z = logits / T (a new tensor unless it is float32 at T = 1)."""
    z = logits.float()
    return z / temperature if temperature != 1.0 else z


def _chunk_stats(
    z: torch.Tensor, targets: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """z [n, V] float32 (consumed: overwritten) -> log p(target) [n], log-sum-exp [n],
    entropy [n] | None."""
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    ent = None
    if with_entropy:
        logp = z.sub_(lse.unsqueeze(-1))
        ent = -(logp.exp().mul_(logp)).sum(dim=-1)
    return lp, lse, ent


_PARAMS_AT = 7  # forward's arguments before *params


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """(hidden [N, H], targets [N], *head params) -> logprobs [N], entropy [N] (zeros when
    not asked for). See the module docstring for why a Function."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        head: HeadFn,
        temperature: float,
        chunk: int,
        with_entropy: bool,
        kernel: bool,
        *params: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        lp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_zeros(n, dtype=torch.float32)
        for sl in _spans(n, chunk):
            logits = head(hidden[sl])
            if kernel and head_kernel.applies(logits):
                c_lp, c_lse, c_ent = head_kernel.stats(
                    logits, targets[sl], temperature, with_entropy
                )
            else:
                c_lp, c_lse, c_ent = _chunk_stats(
                    _scaled(logits, temperature), targets[sl], with_entropy
                )
            del logits
            lp[sl], lse[sl] = c_lp, c_lse
            if c_ent is not None:
                ent[sl] = c_ent
        dev = hidden.device.type
        ctx.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.head, ctx.temperature, ctx.chunk, ctx.kernel = head, temperature, chunk, kernel
        ctx.save_for_backward(hidden, targets, lse, ent, *params)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(() if with_entropy else (ent,)))
        return lp, ent

    @staticmethod
    def backward(
        ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, targets, lse, ent, *params = ctx.saved_tensors
        need_h = ctx.needs_input_grad[0]
        trained = [i for i, p in enumerate(params) if ctx.needs_input_grad[_PARAMS_AT + i]]
        inputs = [params[i] for i in trained]
        g_hidden = torch.zeros_like(hidden) if need_h else None
        g_params: list[torch.Tensor | None] = [None] * len(params)
        if g_lp is None and g_ent is None:
            return (*[None] * _PARAMS_AT, *g_params)
        dev, enabled, dtype = ctx.autocast
        t = ctx.temperature
        for sl in _spans(hidden.shape[0], ctx.chunk):
            h = hidden[sl].detach().requires_grad_(need_h)
            with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
                logits = ctx.head(h)  # [c, V], with the graph back to h and the params
            grad = head_kernel.grad if ctx.kernel and head_kernel.applies(logits) else _grad
            gz = grad(
                logits.detach(),
                targets[sl],
                lse[sl],
                ent[sl],
                None if g_lp is None else g_lp[sl],
                None if g_ent is None else g_ent[sl],
                t,
            )
            wrt = ([h] if need_h else []) + inputs
            if not wrt:
                break
            grads = torch.autograd.grad(logits, wrt, gz)
            del logits, gz
            if need_h:
                assert g_hidden is not None
                g_hidden[sl] = grads[0]
                grads = grads[1:]
            for i, g in zip(trained, grads, strict=True):
                acc = g_params[i]
                g_params[i] = g if acc is None else acc.add_(g)
        for i in trained:  # no tokens (N = 0): zeros, so every rank of a group has grads
            if g_params[i] is None:
                g_params[i] = torch.zeros_like(params[i])
        return (g_hidden, *[None] * (_PARAMS_AT - 1), *g_params)


def _grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    t: float,
) -> torch.Tensor:
    """One chunk's dL/dlogits in the logits' dtype, in torch (module docstring; the
    kernel's `head_kernel.grad` has the same signature): every argument is the chunk's."""
    with torch.no_grad():
        z = _scaled(logits, t)
        shift = lse.unsqueeze(-1)
        # log p, in z's buffer unless z is the head's output (autograd's to keep)
        logp = z - shift if z.data_ptr() == logits.data_ptr() else z.sub_(shift)
        del z
        p = logp.exp()
        if g_ent is not None:  # -p * (g_lp + g_ent * (log p + H)), in logp's buffer
            gz = logp.add_(ent.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1))
            if g_lp is not None:
                gz.add_(g_lp.unsqueeze(-1))
            gz.mul_(p).neg_()
        else:
            assert g_lp is not None
            gz = p.mul_(g_lp.neg().unsqueeze(-1))
        del p, logp
        if g_lp is not None:
            gz.scatter_add_(-1, targets.unsqueeze(-1), g_lp.unsqueeze(-1))
        if t != 1.0:
            gz.div_(t)
        return gz.to(logits.dtype)


def head_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: HeadFn,
    *,
    params: Sequence[torch.Tensor] | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    with_entropy: bool = False,
    kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [N, H], targets [N] int -> log p(target) [N] float32 and, `with_entropy`,
    the entropy [N] float32 of softmax(head(hidden) / temperature), `chunk_tokens` rows at
    a time (module docstring). `head`: the output head (a module or its forward);
    `params`: the tensors it trains (default: a module's parameters that require grad;
    grads reach exactly these and `hidden`); `kernel`: each chunk's passes in
    head_kernel.py's Triton kernels where they run (a CUDA chunk), else in torch."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be [N, H] and targets [N]; got {tuple(hidden.shape)}, "
            f"{tuple(targets.shape)}"
        )
    if params is None:
        params = (
            [p for p in head.parameters() if p.requires_grad]
            if isinstance(head, torch.nn.Module)
            else []
        )
    lp, ent = _ChunkedHeadLogprobs.apply(
        hidden,
        targets.long(),
        head,
        float(temperature),
        chunk_tokens,
        with_entropy,
        kernel,
        *params,
    )
    return lp, (ent if with_entropy else None)


# -- inside a transformers causal LM's forward ----------------------------------------
_UNSET = object()


def chunkable(model: Any) -> str | None:
    """Why `model_head_logprobs` cannot run on `model` (None: it can)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module):
        return f"{type(model).__name__} has no output head module"
    cfg = getattr(model, "config", None)
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(cfg, key, None) not in (None, 1.0):
            return f"its forward transforms the head's logits ({key})"
    return None


@contextlib.contextmanager
def _head_forward(head: torch.nn.Module, fn: Callable[..., Any]) -> Iterator[None]:
    """For the block, `head(x)` runs `fn(x)` (hooks of the module still wrap it)."""
    saved = head.__dict__.get("forward", _UNSET)
    head.forward = fn  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        if saved is _UNSET:
            del head.forward
        else:
            head.forward = saved


def model_head_logprobs(
    model: Any,
    inputs: dict[str, Any],
    select: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    kernel: bool = False,
    path: str = "logprob_chunk_tokens",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`model(**inputs)` with its head replaced for the call: `select` maps the hidden
    states the model hands its head ([B, K, H]) to the N predicting positions [N, H]
    (in `targets`' order), and `head_logprobs` runs on them. -> log-probs [N] and, with
    `with_entropy`, the entropy [N] (with grad only if `entropy_grad`)."""
    why = chunkable(model)
    if why is not None:
        raise ValueError(f"model_head_logprobs: cannot chunk the head: {why}")
    head = model.get_output_embeddings()
    original = head.forward  # the module's own forward (peft's, FP32Linear's, ...)
    produced: list[torch.Tensor] = []

    def chunked(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The parameters as the forward sees them, read here: FSDP2 swaps the unsharded
        # ones in only for the root's forward (and backward).
        grad = torch.is_grad_enabled()
        lp, ent = head_logprobs(
            select(hidden),
            targets,
            original,
            params=[p for p in head.parameters() if p.requires_grad] if grad else [],
            temperature=temperature,
            chunk_tokens=chunk_tokens,
            with_entropy=with_entropy,
            kernel=kernel,
        )
        cols = [lp] if ent is None else [lp, ent if entropy_grad else ent.detach()]
        produced.append(torch.stack(cols, dim=-1))  # [N, 1 or 2]: the model's "logits"
        return produced[-1]

    with _head_forward(head, chunked):
        out = model(**inputs)
    if len(produced) != 1 or out.logits is not produced[0]:
        raise ConfigError(
            path,
            f"{type(model).__name__}'s forward does not return its head's output as "
            "logits unchanged, so its log-probs cannot be chunked: set it to 0",
        )
    res = produced[0]
    return res[:, 0], (res[:, 1] if with_entropy else None)

"""`attn_implementation: varlen`: a packed forward's attention as one flash-attention call
over the packed documents (torch's own `torch.nn.attention.varlen.varlen_attn`, the
varlen kernel flash-attn's `flash_attn_varlen_func` made common), registered with
transformers as an attention kernel under the name "varlen".

Why: a packed forward (stages/packing.py) puts a group's rows back to back in one
[1, T] sequence. transformers' own document masking gives `sdpa` a materialised
[1, 1, T, T] mask whose every block it computes, and `flex_attention` a BlockMask that
needs the compiler; `flash_attention_2/3` do it right but need the flash-attn package,
which the GPU machine lacks. torch >= 2.10 ships the same varlen flash kernel, forward and
backward: no mask, no padding, no T x T anything, each document attending causally to
itself. It also never takes a mask, so it is clear of cuDNN's masked-backward NaN
(stages/common.training_attention).

Contract, with the packed layout of stages/packing.py:
  - a packed forward passes `cu_seq_lens_q`/`cu_seq_lens_k` [B + 1] int32 (the documents'
    cumulative lengths, from 0 to T) and `max_length_q`/`max_length_k` (ints) as model
    kwargs, transformers' FlashAttentionKwargs names, which every decoder layer hands to
    its attention function (`packed_kwargs` builds them on the host: no device sync);
    it passes an all-ones [1, T] attention mask, so transformers' mask builder neither
    looks for packed documents in the position ids nor builds a T x T mask (it returns
    None: no padding, causal);
  - any other call (a padded forward, generation with a KV cache) runs exactly
    transformers' `sdpa`, with sdpa's mask builder (registered under this name too).

Kernels: on CUDA with bf16/fp16 activations or under bf16/fp16 autocast (which casts
SDPA's inputs but not a custom kernel's, so this module casts them), torch's varlen flash
kernel; anywhere else (the CPU, float32) the reference below, SDPA over a block-diagonal
causal mask built from the same cumulative lengths, which the CPU tests compare against
the padded forward. Not with sliding-window layers, nor on a GPU before compute
capability 8.0 or with head widths flash attention lacks: `unsupported` says why, and the
roles refuse those at setup (stages/packing.check_packing).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    # Read once, outside any compiled frame: its arguments changed between releases.
    _VARLEN_PARAMS = frozenset(inspect.signature(_varlen_attn).parameters)
except ImportError:
    _varlen_attn = None
    _VARLEN_PARAMS = frozenset()

NAME = "varlen"
_HALF = (torch.bfloat16, torch.float16)


def register() -> None:
    """Make `attn_implementation="varlen"` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def unsupported(model: Any) -> str | None:
    """Why a packed forward of `model` cannot run here (None: it can), checked at setup
    rather than failing in the first step: sliding-window layers anywhere; on a GPU, no
    varlen kernel in this torch, a GPU older than flash attention's (compute capability
    8.0), or a head width the kernel lacks."""
    cfg = getattr(model, "config", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:  # Qwen2/Qwen3: per-layer kinds (sliding_window alone means nothing)
        sliding = "sliding_attention" in layer_types
    else:  # Mistral and kin: a window in the config applies to every layer
        sliding = getattr(cfg, "sliding_window", None) is not None
    if sliding:
        return "the model has sliding-window attention layers"
    param = next(iter(model.parameters()), None)
    if param is None or param.device.type != "cuda":
        return None  # the reference path
    if _varlen_attn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10)"
    major, minor = torch.cuda.get_device_capability(param.device)
    if major < 8:
        return f"flash attention needs compute capability >= 8.0; this GPU has {major}.{minor}"
    heads = getattr(cfg, "num_attention_heads", 0) or 1
    dim = getattr(cfg, "head_dim", None) or getattr(cfg, "hidden_size", 0) // heads
    if dim % 8 or dim > 256:
        return f"flash attention takes head widths that are multiples of 8 up to 256, not {dim}"
    return None


def packed_kwargs(lengths: Sequence[int], device: torch.device) -> dict[str, Any]:
    """The model kwargs of a packed forward whose documents are `lengths` tokens long."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    cu_t = torch.tensor(cu, dtype=torch.int32).to(device, non_blocking=True)
    longest = max((int(n) for n in lengths), default=0)
    return {
        "cu_seq_lens_q": cu_t,
        "cu_seq_lens_k": cu_t,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature -> ([1, T, H, D], None)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError("attn_implementation 'varlen' does not support sliding-window layers")
    if dropout:
        raise ValueError("attn_implementation 'varlen' has no attention dropout")
    # The all-ones mask a packed forward passes usually comes back as None; any mask
    # here is that one (no padding), so the documents in `cu` are the whole story.
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    dtype = _compute_dtype(q)
    if _varlen_attn is not None and q.is_cuda and dtype in _HALF:
        q, k, v = (x.to(dtype) for x in (q, k, v))
        # Not int(): under compile_layers (dynamic shapes) that would specialise the
        # compiled layer on each group's longest document, a recompile per group.
        out = _flash(q, k, v, cu, kwargs["max_length_q"], scale)
    else:
        out = reference(q, k, v, cu, scale)
    return out.unsqueeze(0), None


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: under autocast, its dtype. Queries and keys come out
    of RoPE in float32 when the residual stream is float32 (float32 weights under bf16
    autocast: RoPE's cos/sin take the hidden states' dtype), and autocast casts SDPA's
    inputs, not a custom kernel's; transformers' flash path casts them the same way."""
    dev = q.device.type
    if q.dtype == torch.float32 and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return q.dtype


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float
) -> torch.Tensor:
    """[T, H, D] causal attention of each document [cu[i], cu[i+1]) to itself, by SDPA
    over a [T, T] block-diagonal causal mask (the CPU path and the tests' reference)."""
    t = q.shape[0]
    at = torch.arange(t, device=q.device)
    doc = torch.searchsorted(cu[1:].to(q.device, torch.int64), at, right=True)  # [T]
    mask = (doc[:, None] == doc[None, :]) & (at[:, None] >= at[None, :])
    rep = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(rep, dim=1) if rep > 1 else x for x in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )  # [H, T, D]
    return out.transpose(0, 1)


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale: float
) -> torch.Tensor:
    params = _VARLEN_PARAMS
    rep = q.shape[1] // k.shape[1]
    extra: dict[str, Any] = {}
    if rep > 1 and "enable_gqa" in params:
        extra["enable_gqa"] = True
    elif rep > 1:  # torch 2.10/2.11: no grouped-query flag; repeat as transformers' sdpa does
        k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
    # torch 2.10 spells causal `is_causal=True`; later ones a (left, right) window
    extra |= {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "scale" in params:
        extra["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError("this torch's varlen_attn has no scale argument; the model needs one")
    q, k, v = (x.contiguous() for x in (q, k, v))
    return _varlen_attn(q, k, v, cu, cu, longest, longest, **extra)

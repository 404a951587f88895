"""The native engine's decode step in few kernels (issue 25 item 2).

The module path (model.NativeModel.decode over the HF modules) launches about 40 kernels
per layer: 8 for each RMSNorm (cast, pow, mean, add, rsqrt, mul, cast, mul), three q/k/v
GEMMs, 10 for RoPE on q and k (slice, neg, cat, two muls, add, twice), a boolean mask
turned into an additive one inside every attention call, two GEMMs and SiLU, mul for the
MLP, and each residual add on its own. On an H200 a decode step of Qwen2-0.5B at 256
sequences carried ~4.6 ms of cost independent of bytes (bench/RESULTS.md): the kernels,
not the weights.

Here one layer's decode is:
  add_rms_norm   residual add + RMSNorm in one function (the first layer's has no add)
  qkv GEMM       q, k and v from one [Hq*D + 2*Hkv*D, H] weight (Qwen2's biases merged)
  qkv_rope       split, Qwen3's per-head q/k norms, RoPE on q and k, cast to the cache dtype
  2 index writes K and V into each row's slot at its position (cache.write)
  attention      SDPA against an additive mask built once per step, not once per layer
                 (cache.attend; the paged layout's runs its own kernel)
  o GEMM, add_rms_norm, gate_up GEMM ([2I, H]), silu_mul, down GEMM
On CUDA, with `compile_decode`, the three elementwise functions go through torch.compile
(inductor: one kernel each, precision casts emulated so values round as eager's do), and
the whole step is still captured in the engine's CUDA graphs. Elsewhere they run eagerly
(CPU tests run the same functions, so the fused path is tested without a GPU).

Weights. The merged q/k/v and gate/up weights are our own tensors and the HF modules'
parameters are re-pointed to views of them (`param.data = merged[a:b]`), so memory is not
doubled and an in-place weight load (`param.copy_`, rollout/weights.InPlaceWeights)
writes into the merged tensor directly. A parameter whose storage was replaced (aliased
actor tensors) is copied back in by `refresh()`, which the engine runs after every
complete weight update and before re-capturing its graphs. LoRA adapters held unmerged
wrap the modules, so the engine drops the fused path for them (`NativeModel.unfuse`).

Invariants: the functions apply the HF modules' ops in the HF modules' order (RMSNorm:
float32 variance, the weight times the input-dtype normed value; RoPE: x*cos + rot(x)*sin;
MLP: silu(gate) * up), so eager values equal the module path's up to GEMM blocking of
the merged projections.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridflow.stages.rollout.native.forward import rope_write

log = logging.getLogger("hybridflow.rollout.native")

_ACTS = ("silu",)  # hidden_act values whose MLP is silu(gate) * up


def unfusable(hf_model: Any) -> str | None:
    """Why this model's layers cannot take the fused path (None: they can)."""
    cfg = hf_model.config
    act = getattr(cfg, "hidden_act", None)
    if act not in _ACTS:
        return f"hidden_act {act!r} (fused: {', '.join(_ACTS)})"
    for i, layer in enumerate(hf_model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        parts = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
        if not all(type(m) is torch.nn.Linear for m in parts):  # e.g. peft's LoRA layers
            return f"layer {i}: projections are not plain nn.Linear"
        if len({m.weight.dtype for m in parts} | {m.weight.device for m in parts}) != 2:
            return f"layer {i}: projections differ in dtype or device"
        for group in (parts[:3], parts[3:]):
            if len({m.bias is None for m in group}) != 1:
                return f"layer {i}: some of q/k/v (or gate/up) have a bias and some not"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not hasattr(norm, "variance_epsilon"):
                return f"layer {i}: {type(norm).__name__} is not an RMSNorm"
    if not hasattr(hf_model.model.norm, "variance_epsilon"):
        return "the final norm is not an RMSNorm"
    return None


# -- the elementwise functions (compiled on CUDA) -----------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen2/Llama RMSNorm forward, op for op."""
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, then the next RMSNorm -> (normed, new residual stream)."""
    x = x + delta
    return rms_norm(x, weight, eps), x


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's `apply_rotary_pos_emb` for one tensor (same ops, same order)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def qkv_rope(
    qkv: torch.Tensor,  # [B, (Hq + 2 Hkv) * D], the merged projection's output
    cos: torch.Tensor,  # [B, D]
    sin: torch.Tensor,  # [B, D]
    q_norm: torch.Tensor | None,  # [D] Qwen3's per-head norm weights, or None
    k_norm: torch.Tensor | None,
    eps: float,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> q [B, Hkv, G, D], k [B, Hkv, D], v [B, Hkv, D], all in `dtype` (the cache's)."""
    b = qkv.shape[0]
    kv = kv_heads * head_dim
    q = qkv[:, : qkv.shape[1] - 2 * kv].view(b, kv_heads, -1, head_dim)
    k = qkv[:, qkv.shape[1] - 2 * kv : qkv.shape[1] - kv].view(b, kv_heads, head_dim)
    v = qkv[:, qkv.shape[1] - kv :].view(b, kv_heads, head_dim)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
    if k_norm is not None:
        k = rms_norm(k, k_norm, eps)
    q = rope(q, cos[:, None, None, :], sin[:, None, None, :])
    k = rope(k, cos[:, None, :], sin[:, None, :])
    return q.to(dtype), k.to(dtype), v.to(dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the merged [.., 2I] projection (HF: act(gate_proj(x)) * up_proj(x))."""
    i = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :i]) * gate_up[..., i:]


@dataclass
class _Layer:
    qkv_w: torch.Tensor  # [(Hq + 2 Hkv) * D, H]
    qkv_b: torch.Tensor | None
    gate_up_w: torch.Tensor  # [2I, H]
    gate_up_b: torch.Tensor | None
    # (parameter, its view in the merged tensor) pairs: refresh() copies a replaced one back
    views: list[tuple[torch.nn.Parameter, torch.Tensor]]


def _merge(params: list[torch.nn.Parameter]) -> tuple[torch.Tensor, list[Any]]:
    """One tensor holding `params` stacked on dim 0; each parameter re-pointed at its view."""
    merged = torch.cat([p.detach() for p in params], dim=0)
    views, at = [], 0
    for p in params:
        view = merged.narrow(0, at, p.shape[0])
        p.data = view
        views.append((p, view))
        at += p.shape[0]
    return merged, views


class FusedDecode:
    """The merged weights and the decode step over them (see the module docstring)."""

    def __init__(self, model: Any, *, compile_fns: bool = False, rope_kernel: bool = False) -> None:
        self.model = model  # the NativeModel: its modules, cos/sin, heads, dtype
        # qkv_rope and the K/V writes as one Triton kernel per layer (rope_write.py), where
        # it computes what they do (CUDA; projections, tables, norms and cache of one dtype)
        # decided once: the cache holds K/V in model.dtype (NativeModel's invariant)
        norms = tuple(None if x is None else x.weight for x in model.qk_norms[0])
        self.rope_kernel = rope_kernel and rope_write.applies(
            model.dtype, model.cos, norms, model.dtype, model.head_dim, model.device
        )
        self.layers: list[_Layer] = []
        with torch.no_grad():
            for layer in model.layers:
                qkv, gu = _qkv(layer.self_attn), _gu(layer.mlp)
                qkv_w, views = _merge([m.weight for m in qkv])
                gate_up_w, more = _merge([m.weight for m in gu])
                views += more
                qkv_b = gate_up_b = None
                if qkv[0].bias is not None:  # unfusable() checked: all or none biased
                    qkv_b, more = _merge([m.bias for m in qkv])
                    views += more
                if gu[0].bias is not None:
                    gate_up_b, more = _merge([m.bias for m in gu])
                    views += more
                self.layers.append(_Layer(qkv_w, qkv_b, gate_up_w, gate_up_b, views))
        self.uncompile()
        if compile_fns:
            self._compile()

    def uncompile(self) -> None:
        """The eager functions (at build, or after a compile failed on this machine)."""
        self._norm: Callable[..., Any] = rms_norm
        self._add_norm: Callable[..., Any] = add_rms_norm
        self._qkv_rope: Callable[..., Any] = qkv_rope
        self._silu_mul: Callable[..., Any] = silu_mul
        self.compiled = False

    def _compile(self) -> None:
        # dynamic: one compilation serves every batch bucket; emulate_precision_casts:
        # inductor keeps bf16 intermediates in float32 unless told to round where eager
        # does, and the rollout's log-probs should be eager's.
        opts = {"emulate_precision_casts": True}

        def c(fn: Callable[..., Any]) -> Callable[..., Any]:
            return torch.compile(fn, dynamic=True, fullgraph=True, options=opts)

        self._norm, self._add_norm = c(rms_norm), c(add_rms_norm)
        self._qkv_rope, self._silu_mul = c(qkv_rope), c(silu_mul)
        self.compiled = True

    @torch.no_grad()
    def refresh(self) -> int:
        """Copy back every parameter whose storage is no longer its merged view (an aliased
        or replaced tensor); returns how many. After each complete weight update."""
        copied = 0
        for layer in self.layers:
            for param, view in layer.views:
                if param.data_ptr() != view.data_ptr():
                    view.copy_(param.detach())
                    copied += 1
        return copied

    def decode(
        self,
        tokens: torch.Tensor,  # [B] int64
        positions: torch.Tensor,  # [B] int64
        rows: torch.Tensor,  # [B] int64 = arange(B)
        cache: Any,  # kv_cache.SlotCache or paged.PagedCache
        n: int,  # attend to positions < n
        out: torch.Tensor | None = None,  # [B, V] float32 to write the logits into
    ) -> torch.Tensor:
        """NativeModel.decode's contract, in few kernels -> logits [B, V] (`out` if given:
        the head's output is cast into it, not first into a float32 copy of its own)."""
        m = self.model
        b = tokens.shape[0]
        kernel = self.rope_kernel
        if not kernel:
            cos, sin = m.cos[positions], m.sin[positions]  # [B, D]
        # One additive mask (or paged lengths) per step, one address per row.
        meta = cache.decode_meta(positions, n, m.dtype)
        at = cache.address(rows, positions)
        with m._ctx():
            x = m.embed(tokens)  # [B, H] the residual stream
            delta: torch.Tensor | None = None
            for i, (layer, fw) in enumerate(zip(m.layers, self.layers, strict=True)):
                attn = layer.self_attn
                ln1 = layer.input_layernorm
                if delta is None:
                    h = self._norm(x, ln1.weight, ln1.variance_epsilon)
                else:
                    h, x = self._add_norm(x, delta, ln1.weight, ln1.variance_epsilon)
                q_norm, k_norm = m.qk_norms[i]
                eps = q_norm.variance_epsilon if q_norm is not None else 0.0
                qn = None if q_norm is None else q_norm.weight
                kn = None if k_norm is None else k_norm.weight
                qkv = F.linear(h, fw.qkv_w, fw.qkv_b)
                if kernel:  # split, norms, RoPE and the K/V writes in one launch
                    kc, vc = cache.layer_kv(i)
                    q = rope_write.qkv_rope_write(
                        qkv, m.cos, m.sin, positions, qn, kn, eps, kc, vc, at
                    )
                else:
                    q, k, v = self._qkv_rope(
                        qkv, cos, sin, qn, kn, eps, m.num_kv_heads, m.head_dim, m.dtype
                    )
                    cache.write(i, at, k, v)
                o = cache.attend(i, q, meta, attn.scaling)  # [B, Hkv, G, D]
                o = attn.o_proj(o.reshape(b, -1))
                ln2 = layer.post_attention_layernorm
                h, x = self._add_norm(x, o, ln2.weight, ln2.variance_epsilon)
                gu = F.linear(h, fw.gate_up_w, fw.gate_up_b)
                delta = layer.mlp.down_proj(self._silu_mul(gu))
            assert delta is not None
            h, _ = self._add_norm(x, delta, m.norm.weight, m.norm.variance_epsilon)
            if out is None:
                return m.lm_head(h).float()
            head = m.lm_head
            if (
                type(head) is torch.nn.Linear
                and head.bias is None
                and out.dtype == h.dtype == head.weight.dtype
            ):
                # the engine's logits buffer in the head's own dtype (sampling/kernel.py reads
                # bf16): the GEMM writes it directly, no [B, V] copy
                return torch.mm(h, head.weight.t(), out=out)
            return out.copy_(head(h))


def _qkv(attn: Any) -> list[Any]:
    return [attn.q_proj, attn.k_proj, attn.v_proj]


def _gu(mlp: Any) -> list[Any]:
    return [mlp.gate_proj, mlp.up_proj]

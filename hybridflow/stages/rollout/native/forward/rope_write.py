"""One decode layer's q/k/v epilogue in one Triton kernel: split the merged projection,
Qwen3's per-head q/k RMSNorms, RoPE on q and k, and the K/V writes into the cache.

fused.py's compiled path runs this as `qkv_rope` (one inductor kernel, sometimes two)
plus two index writes (`cache.write`: kv[i, 0][a, :, p] = k, kv[i, 1][...] = v), and
gathers cos/sin at the step's positions first: on an H200 the K/V writes alone were 48
kernels and 195 us of a Qwen2-0.5B step (bench/RESULTS.md, session 11). Here it is one
launch per layer, reading cos/sin from the model's tables at each row's position.

Consumes, per layer:
  qkv        [B, (Hq + 2 Hkv) * D]   the merged projection's output (bias included)
  cos, sin   [L, D]                  the model's RoPE tables (NativeModel.cos / .sin)
  positions  [B] int64               each row's position
  q_norm, k_norm [D] or None         Qwen3's per-head norm weights
  k_cache, v_cache [A, Hkv, P, D]    kv[i, 0] / kv[i, 1] of either cache layout
  at         ([B], [B]) int64        cache.address(rows, positions): row b's K/V go to
                                     k_cache[a[b], :, p[b]]
Produces q [B, Hkv, G, D] in the cache dtype, and writes k, v.

Rounding follows the eager ops (fused.qkv_rope, itself HF's): every elementwise op's
result is rounded to the tensor dtype as eager does (x*cos, rot*sin, their sum; the
norm's weight times the normed value cast back to the input dtype), with float32 inside
each op. So the kernel applies only where the projection output, the RoPE tables, the
norm weights and the cache share one dtype (a bfloat16 or float32 rollout model):
`applies()` says so, else the caller keeps the compiled function and the index writes
(e.g. a float32 model under bf16 autocast, where eager promotes to float32 midway).

Invariants: no host sync, shapes depend on B alone (CUDA-graph safe); each row writes
exactly its own cache position, so rows never race.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.models.kernels import TRITON, runs_on

if TRITON:
    import triton
    import triton.language as tl


def applies(
    qkv_dtype: torch.dtype,
    tables: torch.Tensor,
    norms: tuple[Any, Any],
    cache_dtype: torch.dtype,
    head_dim: int,
    device: torch.device,
) -> bool:
    """True where the kernel computes what the eager ops do (see the module docstring)."""
    dtypes = {qkv_dtype, tables.dtype, cache_dtype} | {w.dtype for w in norms if w is not None}
    return runs_on(device) and len(dtypes) == 1 and head_dim in (64, 128, 256)


if TRITON:

    @triton.jit
    def _r(x, DT: tl.constexpr):
        """Round a float32 value to the tensor dtype and back (eager's per-op rounding).
        bfloat16 by integer arithmetic, round to nearest even (c10's rounding for finite
        values): a plain `.to(bf16).to(fp32)` pair measured off by an ulp against eager on
        an H100 (session 16), as if the compiler had dropped the round trip."""
        if tl.bfloat16 == DT:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        return x.to(DT).to(tl.float32)

    @triton.jit
    def _halves(src, H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr):
        """H heads of D values at `src` -> their first and second halves, float32,
        [H_PAD, D // 2] each (padding heads read as 0)."""
        h = tl.arange(0, H_PAD)[:, None]
        d = tl.arange(0, D // 2)[None, :]
        x1 = tl.load(src + h * D + d, mask=h < H, other=0.0).to(tl.float32)
        x2 = tl.load(src + h * D + D // 2 + d, mask=h < H, other=0.0).to(tl.float32)
        return x1, x2

    @triton.jit
    def _norm(x1, x2, weight, eps, D: tl.constexpr, DT: tl.constexpr):
        """Per-head RMSNorm (fused.rms_norm): float32 variance, the weight times the
        normed value rounded to DT, rounded again."""
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D  # [H_PAD]
        inv = 1.0 / tl.sqrt_rn(var + eps)
        d = tl.arange(0, D // 2)
        w1 = tl.load(weight + d).to(tl.float32)
        w2 = tl.load(weight + D // 2 + d).to(tl.float32)
        x1 = _r(w1[None, :] * _r(x1 * inv[:, None], DT), DT)
        x2 = _r(w2[None, :] * _r(x2 * inv[:, None], DT), DT)
        return x1, x2

    @triton.jit
    def _rope(x1, x2, cos1, cos2, sin1, sin2, DT: tl.constexpr):
        """x*cos + cat(-x2, x1)*sin, each product and the sum rounded as eager's are."""
        y1 = _r(_r(x1 * cos1[None, :], DT) + _r(-x2 * sin1[None, :], DT), DT)
        y2 = _r(_r(x2 * cos2[None, :], DT) + _r(x1 * sin2[None, :], DT), DT)
        return y1, y2

    @triton.jit
    def _store(dst, x1, x2, live, DT: tl.constexpr, HALF: tl.constexpr):
        tl.store(dst, x1.to(DT), mask=live)
        tl.store(dst + HALF, x2.to(DT), mask=live)

    @triton.jit
    def _qkv_rope_write_kernel(
        qkv,
        stride_qkv,
        cos,
        sin,
        stride_cs,
        positions,
        q_norm,
        k_norm,
        eps,
        q_out,  # [B, HQ * D] contiguous
        k_cache,
        v_cache,
        s_a,
        s_h,
        s_p,  # the caches' strides (shared: kv[i, 0] and kv[i, 1] are alike)
        addr_a,
        addr_p,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        HQ_PAD: tl.constexpr,
        HKV_PAD: tl.constexpr,
        D: tl.constexpr,
        Q_NORM: tl.constexpr,
        K_NORM: tl.constexpr,
    ):
        HALF: tl.constexpr = D // 2
        DT: tl.constexpr = q_out.dtype.element_ty
        b = tl.program_id(0)
        pos = tl.load(positions + b)
        d = tl.arange(0, HALF)
        cos1 = tl.load(cos + pos * stride_cs + d).to(tl.float32)
        cos2 = tl.load(cos + pos * stride_cs + HALF + d).to(tl.float32)
        sin1 = tl.load(sin + pos * stride_cs + d).to(tl.float32)
        sin2 = tl.load(sin + pos * stride_cs + HALF + d).to(tl.float32)
        row = qkv + b * stride_qkv
        hq = tl.arange(0, HQ_PAD)[:, None]
        hk = tl.arange(0, HKV_PAD)[:, None]
        dd = d[None, :]
        q1, q2 = _halves(row, HQ, HQ_PAD, D)
        if Q_NORM:
            q1, q2 = _norm(q1, q2, q_norm, eps, D, DT)
        q1, q2 = _rope(q1, q2, cos1, cos2, sin1, sin2, DT)
        _store(q_out + b * HQ * D + hq * D + dd, q1, q2, hq < HQ, DT, HALF)
        at = tl.load(addr_a + b) * s_a + tl.load(addr_p + b) * s_p + hk * s_h + dd
        k1, k2 = _halves(row + HQ * D, HKV, HKV_PAD, D)
        if K_NORM:
            k1, k2 = _norm(k1, k2, k_norm, eps, D, DT)
        k1, k2 = _rope(k1, k2, cos1, cos2, sin1, sin2, DT)
        _store(k_cache + at, k1, k2, hk < HKV, DT, HALF)
        v1, v2 = _halves(row + (HQ + HKV) * D, HKV, HKV_PAD, D)
        _store(v_cache + at, v1, v2, hk < HKV, DT, HALF)


def qkv_rope_write(
    qkv: torch.Tensor,  # [B, (Hq + 2 Hkv) * D]
    cos: torch.Tensor,  # [L, D]
    sin: torch.Tensor,  # [L, D]
    positions: torch.Tensor,  # [B] int64
    q_norm: torch.Tensor | None,  # [D]
    k_norm: torch.Tensor | None,  # [D]
    eps: float,
    k_cache: torch.Tensor,  # [A, Hkv, P, D]
    v_cache: torch.Tensor,  # [A, Hkv, P, D], strides equal to k_cache's
    at: tuple[torch.Tensor, torch.Tensor],  # ([B], [B]) int64
) -> torch.Tensor:
    """-> q [B, Hkv, G, D] (cache dtype); K and V written at `at` (module docstring)."""
    b = qkv.shape[0]
    hkv, d = k_cache.shape[1], k_cache.shape[3]
    hq = qkv.shape[1] // d - 2 * hkv
    assert v_cache.stride() == k_cache.stride() and k_cache.stride(3) == 1
    assert qkv.stride(1) == 1 and cos.stride(1) == 1
    q = torch.empty(b, hq * d, dtype=k_cache.dtype, device=qkv.device)
    dummy = cos  # an unused pointer where a norm is absent
    _qkv_rope_write_kernel[(b,)](
        qkv,
        qkv.stride(0),
        cos,
        sin,
        cos.stride(0),
        positions,
        dummy if q_norm is None else q_norm,
        dummy if k_norm is None else k_norm,
        eps,
        q,
        k_cache,
        v_cache,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        at[0],
        at[1],
        HQ=hq,
        HKV=hkv,
        HQ_PAD=triton.next_power_of_2(hq),
        HKV_PAD=triton.next_power_of_2(hkv),
        D=d,
        Q_NORM=q_norm is not None,
        K_NORM=k_norm is not None,
        num_warps=4,
    )
    return q.view(b, hkv, hq // hkv, d)

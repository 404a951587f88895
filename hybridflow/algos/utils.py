"""Masked statistics: the one place where padding is kept out of every number.

Consumes a tensor `x` and a `mask` of the same shape (bool, or 0/1 of any dtype;
nonzero = valid). Produces sums, means, variances and whitened tensors computed over
valid positions only.

Invariants, relied on by every other module in `hybridflow.algos`:
- Padding never leaks: values at mask=0 positions are replaced by 0 with `torch.where`
  *before* any arithmetic, so even NaN/inf garbage there changes no result and no
  gradient (`x * mask` would turn NaN * 0 into NaN, and a NaN that is masked only
  after arithmetic still poisons the backward pass).
- Empty selections are never silently zero. A mean/variance over a slice with no valid
  element raises `AlgorithmInputError`, unless the caller passes `empty=<value>` to say
  what an empty slice means for it (e.g. a fully padded row inside a per-row mean).
- An unbiased variance over a single valid element raises for the same reason.
- Element-wise outputs (`masked_whiten`) are 0 at padding positions.
"""

from __future__ import annotations

import torch

from hybridflow.errors import AlgorithmInputError

Dim = int | tuple[int, ...] | None


def check_same_shape(where: str, **tensors: torch.Tensor) -> None:
    """Raise unless every named tensor has the same shape (no silent broadcasting)."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.shape != first.shape:
            raise AlgorithmInputError(
                f"{where}: `{name}` has shape {tuple(t.shape)} but `{first_name}` has "
                f"{tuple(first.shape)}; they must match exactly"
            )


def check_ndim(where: str, name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    """Raise unless `t` has `ndim` dimensions; `layout` is the expected shape, e.g. '[B, T]'."""
    if t.dim() != ndim:
        raise AlgorithmInputError(f"{where}: `{name}` must be {layout}, got shape {tuple(t.shape)}")


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """The mask as bool (nonzero = valid). Bool masks pass through without a copy."""
    return mask if mask.dtype == torch.bool else mask != 0


def zero_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`x` with every mask=0 position set to 0 (NaN-safe; gradient is 0 there)."""
    return torch.where(as_bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _count(mask: torch.Tensor, dim: Dim, keepdim: bool) -> torch.Tensor:
    m = as_bool_mask(mask)
    if dim is None:
        return m.sum()
    return m.sum(dim=dim, keepdim=keepdim)


def masked_sum(
    x: torch.Tensor, mask: torch.Tensor, dim: Dim = None, keepdim: bool = False
) -> torch.Tensor:
    """Sum of `x` over valid positions. `x`, `mask`: same shape. An empty slice sums to 0."""
    check_same_shape("masked_sum", x=x, mask=mask)
    xz = zero_padding(x, mask)
    return xz.sum() if dim is None else xz.sum(dim=dim, keepdim=keepdim)


def _fill_empty(
    where: str, stat: torch.Tensor, count: torch.Tensor, need: int, empty: float | None
) -> torch.Tensor:
    """Replace slices with fewer than `need` valid elements by `empty`, or raise if None."""
    short = count < need
    if empty is None:
        if bool(short.any()):
            what = "no valid element" if need == 1 else f"fewer than {need} valid elements"
            raise AlgorithmInputError(
                f"{where}: a reduced slice has {what} (mask is all 0 there); "
                f"pass empty=<value> if that is expected"
            )
        return stat
    return torch.where(short, torch.full_like(stat, empty), stat)


def masked_mean(
    x: torch.Tensor,
    mask: torch.Tensor,
    dim: Dim = None,
    keepdim: bool = False,
    *,
    empty: float | None = None,
) -> torch.Tensor:
    """Mean of `x` over valid positions (all of them if `dim` is None, else along `dim`).

    `x`, `mask`: same shape. A slice with no valid element raises, or gives `empty`.
    """
    s = masked_sum(x, mask, dim, keepdim)
    n = _count(mask, dim, keepdim)
    mean = s / n.clamp(min=1).to(s.dtype)
    return _fill_empty("masked_mean", mean, n, 1, empty)


def masked_var(
    x: torch.Tensor,
    mask: torch.Tensor,
    dim: Dim = None,
    keepdim: bool = False,
    *,
    unbiased: bool = True,
    empty: float | None = None,
) -> torch.Tensor:
    """Variance of `x` over valid positions; `unbiased` divides by (n - 1) instead of n.

    Needs n >= 1 valid elements (n >= 2 if unbiased) in every reduced slice; otherwise
    raises, or gives `empty` for those slices.
    """
    check_same_shape("masked_var", x=x, mask=mask)
    # Zero the padding before any arithmetic: NaN garbage there would otherwise make
    # the backward of (x - mean)**2 NaN even though the forward value is masked out.
    xz = zero_padding(x, mask)
    n = _count(mask, dim, keepdim=dim is not None)
    mean = masked_sum(xz, mask, dim, keepdim=dim is not None) / n.clamp(min=1).to(x.dtype)
    sq = zero_padding((xz - mean) ** 2, mask)
    ss = sq.sum() if dim is None else sq.sum(dim=dim, keepdim=True)
    denom = (n - 1) if unbiased else n
    var = ss / denom.clamp(min=1).to(ss.dtype)
    if dim is not None and not keepdim:
        var, n = var.squeeze(dim), n.squeeze(dim)
    return _fill_empty("masked_var", var, n, 2 if unbiased else 1, empty)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise `x` to unit variance over all valid positions: (x - mean) / sqrt(var + eps).

    Statistics are global over every valid element (unbiased variance), as PPO/REINFORCE++
    whiten advantages over the whole batch. `shift_mean=False` adds the mean back (only
    the scale changes). Output has `x`'s shape and is 0 at padding. Needs >= 2 valid elements.
    """
    xz = zero_padding(x, mask)  # NaN-safe forward *and* backward (see masked_var)
    mean = masked_mean(xz, mask)
    var = masked_var(xz, mask, unbiased=True)
    out = (xz - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return zero_padding(out, mask)


def place_on_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-level rewards [B, T]: `scores` [B] at each row's last valid token, 0 elsewhere.

    Every row of `mask` [B, T] needs at least one valid token (a response with no token
    has nowhere to receive its reward).
    """
    where = "place_on_last_token"
    check_ndim(where, "scores", scores, 1, "[B]")
    check_ndim(where, "mask", mask, 2, "[B, T]")
    if scores.shape[0] != mask.shape[0]:
        raise AlgorithmInputError(
            f"{where}: `scores` has {scores.shape[0]} rows but `mask` has {mask.shape[0]}"
        )
    m = as_bool_mask(mask)
    has_token = m.any(dim=-1)
    if not bool(has_token.all()):
        rows = torch.nonzero(~has_token).flatten().tolist()
        raise AlgorithmInputError(f"{where}: rows {rows} have no valid token to hold the score")
    t_idx = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(m, t_idx, -1).amax(dim=-1)  # [B]
    out = torch.zeros(m.shape, dtype=scores.dtype, device=scores.device)
    out[torch.arange(m.shape[0], device=m.device), last] = scores
    return out

"""Policy and value losses, entropy, log-probs from logits, and loss aggregation.

Consumes per-token tensors laid out [B, T] (B sequences, T response positions) with a
`mask` [B, T] (nonzero = a response token that counts). Produces a scalar loss that is
differentiable w.r.t. the current policy's `logprobs` / the critic's `values`, plus a
`stats` dict of detached 0-dim tensors (call `.item()` when logging, once per step).

Invariants:
- Padding never reaches a loss, a gradient or a stat: inputs are zeroed at mask=0 with
  `torch.where` before any arithmetic (NaN/inf garbage there is harmless).
- Clipped tokens contribute no gradient (that is what clipping means); unclipped valid
  tokens always do.
- Aggregation is one function (`aggregate`) shared by every loss, so the policy, value,
  entropy and KL terms of one update are always normalised the same way.
"""

from __future__ import annotations

import torch

from hybridflow.algos.utils import (
    as_bool_mask,
    check_ndim,
    check_same_shape,
    masked_mean,
    masked_sum,
    zero_padding,
)
from hybridflow.errors import AlgorithmInputError

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

# exp() of a log-ratio beyond this is meaningless for PPO and would overflow in fp16/bf16.
_MAX_LOG_RATIO = 20.0


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    denom: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss `loss_mat` [B, T] over valid tokens to a scalar.

    - `token-mean`: sum over all valid tokens / number of valid tokens (long answers
      weigh more; the PPO/DAPO default).
    - `seq-mean-token-sum`: per-sequence sum, then mean over sequences.
    - `seq-mean-token-mean`: per-sequence mean, then mean over sequences (original GRPO).

    Sequences with no valid token (padding rows) do not count in the sequence modes.
    `denom` replaces the divisor (token count for token-mean, sequence count for the
    seq modes); with gradient accumulation pass the count over the *whole* mini-batch so
    that the sum of the micro-batch losses equals the mini-batch loss. Without `denom`,
    an all-padding `mask` raises.
    """
    check_ndim("aggregate", "loss_mat", loss_mat, 2, "[B, T]")
    check_same_shape("aggregate", loss_mat=loss_mat, mask=mask)
    m = as_bool_mask(mask)
    if mode == "token-mean":
        total, count = masked_sum(loss_mat, m), m.sum()
    elif mode == "seq-mean-token-sum":
        total, count = masked_sum(loss_mat, m), m.any(dim=-1).sum()
    elif mode == "seq-mean-token-mean":
        row_mean = masked_mean(loss_mat, m, dim=-1, empty=0.0)  # [B]; padding rows -> 0
        total, count = row_mean.sum(), m.any(dim=-1).sum()
    else:
        raise AlgorithmInputError(f"aggregate: unknown mode {mode!r}; choose one of {AGG_MODES}")
    if denom is not None:
        if isinstance(denom, (int, float)) and denom <= 0:
            raise AlgorithmInputError(f"aggregate: denom must be > 0, got {denom}")
        return total / denom
    if int(count) == 0:
        raise AlgorithmInputError(
            f"aggregate({mode}): mask has no valid token, nothing to average "
            "(pass denom= to define the divisor for an empty micro-batch)"
        )
    return total / count.to(total.dtype)


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    dual_clip_c: float | None = None,
    agg: str = "token-mean",
    *,
    denom: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate, with asymmetric clip range and optional dual-clip.

    Shapes: `logprobs` (current policy, carries grad), `old_logprobs` (behaviour policy),
    `advantages`, `mask`: all [B, T].

    ratio r = exp(logprobs - old_logprobs); per token
        L = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
    and, with dual-clip (Ye et al. 2020, `dual_clip_c` > 1), for A < 0 only:
        L = min(L, -A c)
    which bounds the loss of a negative-advantage token whose ratio exploded.
    `clip_ratio_high` defaults to `clip_ratio_low` (DAPO's clip-higher sets it larger).

    stats: `pg_loss`, `pg_clipfrac` (share of valid tokens where the clip is binding),
    `pg_clipfrac_lower` (share where the dual clip is binding; 0 without dual-clip),
    `ppo_kl` (mean of old - new log-prob, the k1 estimate of KL(old || new)).
    """
    where = "ppo_policy_loss"
    check_ndim(where, "logprobs", logprobs, 2, "[B, T]")
    check_same_shape(
        where, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask
    )
    if clip_ratio_high is None:
        clip_ratio_high = clip_ratio_low
    if not 0.0 <= clip_ratio_low < 1.0 or clip_ratio_high < 0.0:
        raise AlgorithmInputError(
            f"{where}: need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, "
            f"got low={clip_ratio_low}, high={clip_ratio_high}"
        )
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise AlgorithmInputError(f"{where}: dual_clip_c must be > 1, got {dual_clip_c}")
    m = as_bool_mask(mask)
    logprobs, old_logprobs = zero_padding(logprobs, m), zero_padding(old_logprobs, m)
    adv = zero_padding(advantages, m)

    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = masked_mean((loss_clipped > loss_unclipped).to(adv.dtype), m)

    if dual_clip_c is not None:
        loss_bound = -adv * dual_clip_c
        negative = adv < 0
        dual_binding = (loss_mat > loss_bound) & negative
        loss_mat = torch.where(negative, torch.minimum(loss_mat, loss_bound), loss_mat)
        clipfrac_lower = masked_mean(dual_binding.to(adv.dtype), m)
    else:
        clipfrac_lower = torch.zeros((), dtype=adv.dtype, device=adv.device)

    loss = aggregate(loss_mat, m, agg, denom=denom)
    stats = {
        "pg_loss": loss.detach(),
        "pg_clipfrac": clipfrac.detach(),
        "pg_clipfrac_lower": clipfrac_lower.detach(),
        "ppo_kl": masked_mean(-log_ratio, m).detach(),
    }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None = 0.2,
    agg: str = "token-mean",
    *,
    denom: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss 0.5 * max((V - R)^2, (clip(V, V_old +- clip_range) - R)^2).

    Shapes: `values` (current critic, carries grad), `old_values` (critic at rollout
    time), `returns`, `mask`: all [B, T]. `clip_range=None` gives the plain 0.5 * MSE.
    stats: `vf_loss`, `vf_clipfrac` (share of valid tokens where the clipped term is the
    larger one), `vpred_mean`.
    """
    where = "value_loss"
    check_ndim(where, "values", values, 2, "[B, T]")
    check_same_shape(where, values=values, old_values=old_values, returns=returns, mask=mask)
    if clip_range is not None and clip_range < 0:
        raise AlgorithmInputError(f"{where}: clip_range must be >= 0 or None, got {clip_range}")
    m = as_bool_mask(mask)
    values, old_values = zero_padding(values, m), zero_padding(old_values, m)
    returns = zero_padding(returns, m)

    loss_unclipped = (values - returns) ** 2
    if clip_range is None:
        loss_mat = loss_unclipped
        clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        v_clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        loss_clipped = (v_clipped - returns) ** 2
        loss_mat = torch.maximum(loss_unclipped, loss_clipped)
        clipfrac = masked_mean((loss_clipped > loss_unclipped).to(values.dtype), m)
    loss = 0.5 * aggregate(loss_mat, m, agg, denom=denom)
    stats = {
        "vf_loss": loss.detach(),
        "vf_clipfrac": clipfrac.detach(),
        "vpred_mean": masked_mean(values, m).detach(),
    }
    return loss, stats


def _row_chunks(n_rows: int, chunk_size: int | None) -> list[slice]:
    if chunk_size is None or chunk_size >= n_rows:
        return [slice(0, n_rows)]
    if chunk_size < 1:
        raise AlgorithmInputError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    return [slice(i, min(i + chunk_size, n_rows)) for i in range(0, n_rows, chunk_size)]


def entropy_from_logits(
    logits: torch.Tensor, *, chunk_size: int | None = None, upcast: bool = True
) -> torch.Tensor:
    """Entropy of softmax(logits) per position: logits [..., V] -> [...] (e.g. [B, T]).

    H = -sum(p * log p) with log p = log_softmax(l): stable for large logits (no
    overflow, no cancellation between two ~max(l) terms).
    Assumes finite logits (a -inf logit makes 0 * -inf = NaN; mask with a large negative
    number instead). `upcast` computes in float32 (bf16 logits lose too much precision);
    `chunk_size` rows of the flattened [N, V] are processed at a time to bound the
    temporary [chunk, V] buffers when no gradient is needed.
    """
    v = logits.shape[-1]
    flat = logits.reshape(-1, v)
    parts = []
    for sl in _row_chunks(flat.shape[0], chunk_size):
        chunk = flat[sl].float() if upcast else flat[sl]
        # log_softmax shifts by the max internally, so nothing overflows and there is no
        # cancellation (lse(l) - sum(p * l) computes 1e4 + ln 2 - 1e4 in float32 and
        # loses the ln 2). It was also the fastest form measured on CPU (~3x the former).
        logp = torch.log_softmax(chunk, dim=-1)
        parts.append(-(logp.exp() * logp).sum(dim=-1))
    return torch.cat(parts).reshape(logits.shape[:-1])


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    agg: str = "token-mean",
    *,
    denom: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The term to ADD to the policy loss for an entropy bonus: -coef * aggregate(entropy).

    `entropy` [B, T] (from `entropy_from_logits`, with grad), `mask` [B, T].
    stats: `entropy` (aggregated, unscaled).
    """
    ent = aggregate(entropy, mask, agg, denom=denom)
    return -coef * ent, {"entropy": ent.detach()}


def logprobs_from_logits(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """Log-probability of each token: logits [B, T, V], tokens [B, T] -> [B, T].

    Computed as `logits[token] - logsumexp(logits)`, which never materialises the
    [B, T, V] log-softmax (autograd keeps only the logits it already has plus a [B, T]
    result), unlike `log_softmax(...).gather(...)`. Logits must already be aligned with
    the tokens (logits[:, t] predicts tokens[:, t]) and divided by the sampling
    temperature if the log-probs must match the sampler's.

    `mask` [B, T] (optional): padding positions may hold any token id (e.g. -100) and
    get log-prob 0. `upcast` computes in float32; with grad enabled each upcast chunk is
    kept for backward, so `chunk_size` bounds memory mainly under `torch.no_grad()`
    (reference / old log-probs).
    """
    where = "logprobs_from_logits"
    check_ndim(where, "logits", logits, 3, "[B, T, V]")
    if tokens.shape != logits.shape[:-1]:
        raise AlgorithmInputError(
            f"{where}: `tokens` has shape {tuple(tokens.shape)}, expected "
            f"{tuple(logits.shape[:-1])} (logits without the vocab dim)"
        )
    if mask is not None:
        check_same_shape(where, tokens=tokens, mask=mask)
        tokens = torch.where(as_bool_mask(mask), tokens, torch.zeros_like(tokens))
    vocab = logits.shape[-1]
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise AlgorithmInputError(
            f"{where}: token ids must be in [0, {vocab}) at valid positions, got "
            f"min {int(tokens.min())}, max {int(tokens.max())}"
        )
    flat = logits.reshape(-1, vocab)
    flat_tok = tokens.reshape(-1, 1)
    parts = []
    for sl in _row_chunks(flat.shape[0], chunk_size):
        chunk = flat[sl].float() if upcast else flat[sl]
        picked = chunk.gather(-1, flat_tok[sl]).squeeze(-1)
        parts.append(picked - torch.logsumexp(chunk, dim=-1))
    out = torch.cat(parts).reshape(tokens.shape)
    return out if mask is None else zero_padding(out, mask)

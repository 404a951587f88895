"""Rollout correction: importance weights between the rollout engine's and the actor's
log-probs of the same sampled tokens.

The sampler (vLLM, a quantised or differently-fused kernel) and the trainer compute
slightly different probabilities for the same weights, so the samples come from the
rollout's distribution mu, not from the actor's pi_old that the loss assumes. Weighting
the policy loss by pi_old / mu corrects that mismatch (Yao et al. 2025, "Your efficient
RL framework secretly brings you off-policy RL training"; Liu et al. 2025, "When speed
kills stability").

Consumes `old_logprobs` [B, T] (the actor's log pi_old of each response token),
`rollout_logprobs` [B, T] (the sampler's log mu of the same tokens) and `mask` [B, T].
Produces per-token `weights` [B, T] (no gradient: they multiply the per-token policy
loss), the `mask` [B, T] the loss should use (MIS removes whole sequences from it, so
they neither push nor count in the denominator), and detached stats.

    TIS (token level, truncated):   w_t = min(pi_old(y_t) / mu(y_t), C)
    MIS (sequence level, masked):   rho_i = prod_t pi_old(y_it) / mu(y_it)
                                    w_it = rho_i if low <= rho_i <= high, else the
                                    sequence is dropped (mask 0)

Invariant: padding is 0 in `weights` and never enters a stat; a row with no valid token
is neither kept nor dropped (it is not a sequence).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

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

CorrectionMode = Literal["tis", "mis"]  # THE list (the actor's `rollout_correction`)
CORRECTION_MODES: tuple[str, ...] = get_args(CorrectionMode)
# exp() bound for a (sequence) log-ratio: beyond it the weight is capped or masked anyway.
_MAX_LOG_RATIO = 20.0


class Correction(NamedTuple):
    weights: torch.Tensor  # [B, T] importance weights, 0 at padding and dropped rows
    mask: torch.Tensor  # [B, T] bool, the loss mask after correction
    stats: dict[str, torch.Tensor]  # detached 0-dim tensors


@torch.no_grad()
def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "tis",
    *,
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> Correction:
    """Importance weights pi_old / mu for the policy loss (see the module docstring).

    `mode` "tis": token weights truncated at `cap` (C > 0). "mis": sequence ratios, rows
    whose ratio lies outside [`low`, `high`] dropped from the mask.
    stats (over valid tokens of the input mask):
      `mismatch_kl`    k1 estimate of KL(mu || pi_old) = mean(log mu - log pi_old)
      `mismatch_k3`    k3 estimate of the same KL (>= 0, lower variance)
      `weight_mean`, `weight_max`   of the weights actually used (kept tokens)
      `masked_frac`    MIS: share of sequences dropped; TIS: share of tokens capped
    """
    where = "rollout_correction"
    check_ndim(where, "old_logprobs", old_logprobs, 2, "[B, T]")
    check_same_shape(where, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    if mode not in CORRECTION_MODES:
        raise AlgorithmInputError(
            f"{where}: unknown mode {mode!r}; choose one of {CORRECTION_MODES}"
        )
    m = as_bool_mask(mask)
    log_ratio = zero_padding(old_logprobs.float(), m) - zero_padding(rollout_logprobs.float(), m)
    rows = m.any(dim=-1)  # [B] rows that are sequences
    if mode == "tis":
        if cap <= 0:
            raise AlgorithmInputError(f"{where}: cap must be > 0, got {cap}")
        ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        weights = zero_padding(ratio.clamp(max=cap), m)
        kept = m
        masked_frac = masked_mean((ratio > cap).float(), m, empty=0.0)
    else:
        if not 0.0 <= low <= 1.0 <= high:
            raise AlgorithmInputError(f"{where}: need 0 <= low <= 1 <= high, got {low}, {high}")
        seq_log = masked_sum(log_ratio, m, dim=-1)  # [B] log rho_i
        rho = torch.exp(seq_log.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        keep_row = rows & (rho >= low) & (rho <= high)  # [B]
        kept = m & keep_row.unsqueeze(-1)
        weights = zero_padding(rho.unsqueeze(-1).expand_as(log_ratio), kept)
        masked_frac = masked_mean((~keep_row).float(), rows, empty=0.0)
    d = (-log_ratio).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # log mu - log pi_old
    any_kept = bool(kept.any())
    stats = {
        "mismatch_kl": masked_mean(d, m, empty=0.0),
        "mismatch_k3": masked_mean(torch.exp(-d) + d - 1.0, m, empty=0.0),
        "weight_mean": masked_mean(weights, kept) if any_kept else torch.zeros(()),
        "weight_max": weights[kept].max() if any_kept else torch.zeros(()),
        "masked_frac": masked_frac,
    }
    return Correction(weights, kept, stats)

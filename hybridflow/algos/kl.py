"""KL divergence to the reference policy: per-token estimators, coefficient controllers,
and the two ways to apply it (reward penalty, or loss term).

Consumes per-token log-probs [B, T] of the sampled response tokens under the current
policy (`logprobs`) and under the frozen reference (`ref_logprobs`). Every estimator
estimates KL(pi || pi_ref) from samples drawn from pi, per token, with
log_ratio = logprobs - ref_logprobs:

    k1 = log_ratio                          unbiased, can be negative per token
    k2 = 0.5 * log_ratio ** 2               ("mse"), >= 0, biased
    k3 = exp(-log_ratio) + log_ratio - 1    ("low_var_kl"), >= 0, unbiased, low variance
                                            (= exp(ref - logp) - (ref - logp) - 1)

(Schulman, "Approximating KL divergence", 2020.) Sign convention: a policy that puts
more mass than the reference on its own samples has k1 > 0. Also:

    abs = |log_ratio|                       >= 0, biased (a penalty that never pays)
    k1+ = k1 in value, k2 in gradient       straight-through: k2 + sg(k1 - k2)
    k3+ = k3 in value, k2 in gradient       straight-through: k2 + sg(k3 - k2)

As a *loss*, the gradient of k1 has zero mean under pi (E[grad log pi] = 0: it pushes
nowhere on average) and k3's gradient is that of KL(pi_ref || pi); k2's gradient,
log_ratio * grad log pi, is the unbiased gradient of KL(pi || pi_ref). The "+" kinds
report the unbiased k1/k3 value while training with the right gradient (verl's names).

Two modes, pick one per run:
- penalty in the reward (PPO): `apply_kl_penalty` -> token rewards r_t - beta * kl_t,
  with beta from `FixedKLController` or `AdaptiveKLController`;
- loss term (GRPO): `kl_loss`, added to the policy loss with a fixed coefficient.

Invariant: padding positions are 0 in every per-token output and never enter a stat.
"""

from __future__ import annotations

import torch

from hybridflow.algos.losses import aggregate
from hybridflow.algos.utils import (
    as_bool_mask,
    check_ndim,
    check_same_shape,
    masked_mean,
    place_on_last_token,
    zero_padding,
)
from hybridflow.errors import AlgorithmInputError

KL_KINDS = ("k1", "k2", "k3", "abs", "k1+", "k3+")
# verl's names for the same estimators, accepted so configs written for it read the same.
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}

# exp(20) ~ 5e8: beyond this the k3 estimate is clamped anyway; bounding the exponent
# first keeps exp() and its gradient finite.
_MAX_LOG_RATIO = 20.0


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: str = "k3",
    mask: torch.Tensor | None = None,
    *,
    k3_clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate [B, T] from `logprobs` and `ref_logprobs` [B, T].

    `kind`: "k1" | "k2" | "k3" | "abs" | "k1+" | "k3+" (or verl's "kl" | "mse" |
    "low_var_kl"); see the module docstring. `k3_clamp` caps k3 from above (verl uses 10) so one token whose
    reference probability collapsed cannot dominate; None disables it. With `mask`
    [B, T], padding positions are 0 whatever the inputs hold there.
    """
    where = "kl_estimate"
    kind = KL_ALIASES.get(kind, kind)
    if kind not in KL_KINDS:
        raise AlgorithmInputError(
            f"{where}: unknown kind {kind!r}; choose one of {KL_KINDS} "
            f"(or aliases {sorted(KL_ALIASES)})"
        )
    check_same_shape(where, logprobs=logprobs, ref_logprobs=ref_logprobs)
    if mask is not None:
        check_same_shape(where, logprobs=logprobs, mask=mask)
        logprobs, ref_logprobs = zero_padding(logprobs, mask), zero_padding(ref_logprobs, mask)
    log_ratio = logprobs - ref_logprobs
    if kind == "abs":
        kl = log_ratio.abs()
    elif kind.endswith("+"):  # straight-through: value of k1/k3, gradient of k2
        k2 = _estimate(log_ratio, "k2", k3_clamp)
        kl = k2 + (_estimate(log_ratio, kind[:-1], k3_clamp) - k2).detach()
    else:
        kl = _estimate(log_ratio, kind, k3_clamp)
    return kl if mask is None else zero_padding(kl, mask)


def _estimate(log_ratio: torch.Tensor, kind: str, k3_clamp: float | None) -> torch.Tensor:
    """k1 | k2 | k3 of `log_ratio` = logprobs - ref_logprobs [B, T]."""
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    d = (-log_ratio).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # ref - logp
    kl = torch.exp(d) - d - 1.0
    return kl if k3_clamp is None else kl.clamp(max=k3_clamp)


class FixedKLController:
    """A constant KL coefficient. `update` exists so both controllers are used alike."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise AlgorithmInputError(f"FixedKLController: coef must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op."""


class AdaptiveKLController:
    """The adaptive KL coefficient of Ziegler et al. 2019 (PPO for LM fine-tuning).

    After each step, with e = clip(current_kl / target_kl - 1, -0.2, 0.2):
        value <- value * (1 + e * n_steps / horizon)
    so the coefficient grows while the measured KL is above target and shrinks while it
    is below, by at most 20% per `horizon` steps (n_steps = samples in the step).
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: float) -> None:
        if init_coef < 0 or target_kl <= 0 or horizon <= 0:
            raise AlgorithmInputError(
                "AdaptiveKLController: need init_coef >= 0, target_kl > 0, horizon > 0; "
                f"got {init_coef}, {target_kl}, {horizon}"
            )
        self.value = float(init_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move `value` toward keeping `current_kl` (mean per-token KL) at target."""
        err = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon


def make_kl_controller(
    kind: str, coef: float, *, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build a controller: kind "fixed" (coef) or "adaptive" (coef, target_kl, horizon)."""
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise AlgorithmInputError("make_kl_controller: 'adaptive' needs target_kl and horizon")
        return AdaptiveKLController(coef, target_kl, horizon)
    raise AlgorithmInputError(f"make_kl_controller: unknown kind {kind!r}; use fixed|adaptive")


def apply_kl_penalty(
    rewards: torch.Tensor,
    kl: torch.Tensor,
    coef: float,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token rewards with the KL penalty: r_t - coef * kl_t at valid tokens, 0 at padding.

    `rewards`: either sequence scores [B] (placed on each row's last valid token) or
    token rewards [B, T]; `kl` [B, T] from `kl_estimate`; `mask` [B, T].
    stats: `kl` = mean over sequences of each sequence's mean per-token KL (the number
    to feed `AdaptiveKLController.update`), `kl_coef`.
    """
    where = "apply_kl_penalty"
    check_ndim(where, "kl", kl, 2, "[B, T]")
    check_same_shape(where, kl=kl, mask=mask)
    if rewards.dim() == 1:
        rewards = place_on_last_token(rewards, mask)
    check_same_shape(where, rewards=rewards, kl=kl)
    m = as_bool_mask(mask)
    kl = zero_padding(kl, m)
    token_rewards = zero_padding(zero_padding(rewards, m) - coef * kl, m)
    row_kl = masked_mean(kl, m, dim=-1, empty=0.0)  # [B]
    n_rows = m.any(dim=-1)
    stats = {
        "kl": masked_mean(row_kl, n_rows).detach(),
        "kl_coef": torch.tensor(float(coef)),
    }
    return token_rewards, stats


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    kind: str = "k3",
    agg: str = "token-mean",
    *,
    denom: float | torch.Tensor | None = None,
    norm_len: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The KL-as-loss term to ADD to the policy loss: coef * aggregate(kl_estimate(...)).

    `logprobs` [B, T] carries grad; `ref_logprobs`, `mask` [B, T]. Aggregated exactly
    like the policy loss (pass the same `agg`, `denom` and `norm_len`). stats: `kl_loss`
    (unscaled).
    """
    check_ndim("kl_loss", "logprobs", logprobs, 2, "[B, T]")
    kl = kl_estimate(logprobs, ref_logprobs, kind, mask)
    value = aggregate(kl, mask, agg, denom=denom, norm_len=norm_len)
    return coef * value, {"kl_loss": value.detach()}

"""Advantage estimators: GAE, GRPO (and Dr. GRPO), REINFORCE++ (plain and group
baseline), RLOO.

Consumes per-token rewards `token_rewards` [B, T] (sequence scores usually sit on the
last response token, see `place_on_last_token`) or sequence `scores` [B], critic
`values` [B, T] (GAE only), a response `mask` [B, T], and for group estimators
`group_index` [B] (an integer id per sample naming the prompt it answers; the n samples
of one prompt share an id; ids need not be contiguous or sorted).
Produces `advantages` [B, T] and, where the estimator defines them, `returns` [B, T].

Invariants:
- Outputs are 0 at padding; padding inputs (even NaN) change nothing.
- Positions with mask=0 are *skipped* by the backward recursions (GAE, REINFORCE++):
  they are not time steps, receive no reward, and the value after a sequence's last
  valid token is 0 (no bootstrapping from padding). For right-padded responses this is
  the usual recursion; an interior 0 (e.g. a tool-output span in a multi-turn
  response) is jumped over as if absent.
- A group estimator needs >= 2 samples per group (a baseline from the sample itself
  carries no signal); a group of one raises instead of silently giving 0.
- Everything here runs under `torch.no_grad()` and returns float32 (or float64) tensors:
  advantages are targets, never differentiated.

Dispatch: `ADVANTAGE_ESTIMATORS[name]` (an `EstimatorSpec`) is THE estimator table:
does it need critic values? groups? does it define returns? which options? The
`advantages` driver op and the step-logic compiler derive their checks from it, so a
new estimator is one entry here. `compute_advantages(name, ...)` calls any of them.

Defaults: `EstimatorOptions` is THE table of the estimators' option defaults (gamma,
lam, whiten, norm_std, eps). The functions below take theirs from it, the `advantages`
driver op's params dataclass extends it, and the step-logic compiler writes its values,
so a YAML topology and a compiled logic that leave an option unset run with one value.
`lam` is 1.0 (verl's `algorithm.lam`): with gamma = 1 GAE's advantages are then the
Monte-Carlo return minus the value; the `ppo` preset sets its own 0.95.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from hybridflow.algos.utils import (
    as_bool_mask,
    check_ndim,
    check_same_shape,
    masked_sum,
    masked_whiten,
    place_on_last_token,
    zero_padding,
)
from hybridflow.errors import AlgorithmInputError


def _float(t: torch.Tensor) -> torch.Tensor:
    """Accumulate in at least float32 (bf16 recursions drift)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _check_discount(where: str, name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise AlgorithmInputError(f"{where}: {name} must be in [0, 1], got {value}")


# ------------------------------------------------------------------ groups


class _Groups(NamedTuple):
    inverse: torch.Tensor  # [B] group slot 0..G-1 of each sample
    counts: torch.Tensor  # [G] samples per group


def _groups(where: str, group_index: torch.Tensor, batch: int) -> _Groups:
    check_ndim(where, "group_index", group_index, 1, "[B]")
    if group_index.shape[0] != batch:
        raise AlgorithmInputError(
            f"{where}: `group_index` has {group_index.shape[0]} entries for a batch of {batch}"
        )
    if group_index.dtype.is_floating_point or group_index.dtype == torch.bool:
        raise AlgorithmInputError(
            f"{where}: `group_index` must hold integer prompt ids, got dtype {group_index.dtype}"
        )
    ids, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    if bool((counts < 2).any()):
        lonely = ids[counts < 2].tolist()
        raise AlgorithmInputError(
            f"{where}: groups {lonely} have a single sample; a group baseline needs >= 2 "
            "samples per prompt (sample n >= 2 responses and keep a prompt's samples together)"
        )
    return _Groups(inverse, counts)


def _group_mean(x: torch.Tensor, g: _Groups) -> torch.Tensor:
    """Per-sample mean of `x` [B] over its group -> [B]."""
    sums = torch.zeros(g.counts.shape[0], dtype=x.dtype, device=x.device)
    sums.index_add_(0, g.inverse, x)
    return (sums / g.counts.to(x.dtype))[g.inverse]


def _group_std(x: torch.Tensor, mean: torch.Tensor, g: _Groups) -> torch.Tensor:
    """Per-sample unbiased std of `x` [B] over its group (mean from `_group_mean`) -> [B]."""
    sq = torch.zeros(g.counts.shape[0], dtype=x.dtype, device=x.device)
    sq.index_add_(0, g.inverse, (x - mean) ** 2)
    return (sq / (g.counts - 1).to(x.dtype)).sqrt()[g.inverse]


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T]: the sequence value on every valid token, 0 at padding."""
    return zero_padding(per_seq.unsqueeze(-1).expand(mask.shape), mask)


def _check_scores(where: str, scores: torch.Tensor, mask: torch.Tensor) -> None:
    check_ndim(where, "scores", scores, 1, "[B]")
    check_ndim(where, "mask", mask, 2, "[B, T]")
    if scores.shape[0] != mask.shape[0]:
        raise AlgorithmInputError(
            f"{where}: `scores` has {scores.shape[0]} rows but `mask` has {mask.shape[0]}"
        )


# ------------------------------------------------------------------ options


@dataclass
class EstimatorOptions:
    """The estimators' options and their defaults (THE defaults: see the module docstring).
    Each estimator takes the subset its `EstimatorSpec.options` names."""

    gamma: float = 1.0  # discount per response token (GAE, REINFORCE++)
    lam: float = 1.0  # GAE's lambda: 1 = Monte-Carlo returns minus the value, 0 = TD(0)
    # GAE: whiten the advantages over the call's valid tokens (the micro-batch's, or the
    # step's when the advantages op has `scope: step`)
    whiten: bool = True
    norm_std: bool = True  # GRPO: divide by the group's std (false: Dr. GRPO)
    eps: float = 1e-6  # GRPO: added to the group's std before dividing


# ------------------------------------------------------------------ estimators


@torch.no_grad()
def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = EstimatorOptions.gamma,
    lam: float = EstimatorOptions.lam,
    *,
    whiten: bool = EstimatorOptions.whiten,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016) over response tokens.

    `token_rewards`, `values`, `mask`: [B, T]. values[:, t] is the critic's estimate of
    the return from position t (before token t is emitted); token_rewards[:, t] is
    received after emitting token t. With V = 0 after the last valid token:
        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t                       (the critic's regression target)
    Returns (advantages, returns), both [B, T]; `returns` are never whitened,
    `advantages` are whitened over all valid tokens when `whiten` (the PPO practice).
    """
    where = "gae"
    check_ndim(where, "token_rewards", token_rewards, 2, "[B, T]")
    check_same_shape(where, token_rewards=token_rewards, values=values, mask=mask)
    _check_discount(where, "gamma", gamma)
    _check_discount(where, "lam", lam)
    m = as_bool_mask(mask)
    r, v = _float(zero_padding(token_rewards, m)), _float(zero_padding(values, m))
    next_value = torch.zeros_like(r[:, 0])  # [B] V of the next *valid* position
    running = torch.zeros_like(r[:, 0])  # [B] A of the next valid position
    adv_rev = []
    for t in reversed(range(r.shape[1])):
        valid = m[:, t]
        candidate = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * running
        # Padding is skipped: the carries pass through it unchanged.
        running = torch.where(valid, candidate, running)
        next_value = torch.where(valid, v[:, t], next_value)
        adv_rev.append(running)
    advantages = zero_padding(torch.stack(adv_rev[::-1], dim=1), m)
    returns = zero_padding(advantages + v, m)
    if whiten:
        advantages = masked_whiten(advantages, m)
    return advantages, returns


@torch.no_grad()
def grpo_advantages(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor,
    norm_std: bool = EstimatorOptions.norm_std,
    eps: float = EstimatorOptions.eps,
) -> torch.Tensor:
    """GRPO (Shao et al. 2024, outcome supervision): A_i = (s_i - mean_g) / (std_g + eps).

    `scores` [B] one scalar per sample, `group_index` [B], `mask` [B, T]. mean_g and the
    unbiased std_g are over the samples of i's group (i included); `norm_std=False`
    drops the division (Dr. GRPO). The sequence advantage is broadcast to every valid
    token. Returns advantages [B, T].
    """
    where = "grpo_advantages"
    _check_scores(where, scores, mask)
    g = _groups(where, group_index, scores.shape[0])
    s = _float(scores)
    mean = _group_mean(s, g)
    adv = s - mean
    if norm_std:
        adv = adv / (_group_std(s, mean, g) + eps)
    return _broadcast(adv, as_bool_mask(mask))


@torch.no_grad()
def rloo(scores: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = s_i - mean of the *other* samples of i's group.

    `scores` [B], `group_index` [B], `mask` [B, T]. Equivalently
    A_i = n / (n - 1) * (s_i - mean_g) for a group of n. Groups of one raise.
    Returns advantages [B, T] (broadcast over valid tokens, no whitening).
    """
    where = "rloo"
    _check_scores(where, scores, mask)
    g = _groups(where, group_index, scores.shape[0])
    s = _float(scores)
    n = g.counts.to(s.dtype)[g.inverse]  # [B] size of each sample's group
    others_mean = (_group_mean(s, g) * n - s) / (n - 1)
    return _broadcast(s - others_mean, as_bool_mask(mask))


@torch.no_grad()
def reinforce_pp(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = EstimatorOptions.gamma,
    group_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted returns, optionally minus a group baseline,
    whitened over the batch.

    `token_rewards`, `mask`: [B, T] (the KL penalty, if any, already folded in).
        G_t = r_t + gamma * G_{t+1}   (over valid tokens, 0 after the last)
    Plain: A = whiten(G). With `group_index` [B] ("REINFORCE++-baseline"):
    A = whiten(G - b_g) where b_g is the mean over the group of each sample's total
    return G_0 (= its score when rewards are outcome-only and gamma = 1).
    Whitening is over all valid tokens of the batch. Returns (advantages, returns=G).
    """
    where = "reinforce_pp"
    check_ndim(where, "token_rewards", token_rewards, 2, "[B, T]")
    check_same_shape(where, token_rewards=token_rewards, mask=mask)
    _check_discount(where, "gamma", gamma)
    m = as_bool_mask(mask)
    r = _float(zero_padding(token_rewards, m))
    running = torch.zeros_like(r[:, 0])  # [B] G of the next valid position
    ret_rev = []
    for t in reversed(range(r.shape[1])):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        ret_rev.append(running)
    returns = zero_padding(torch.stack(ret_rev[::-1], dim=1), m)
    centred = returns
    if group_index is not None:
        g = _groups(where, group_index, r.shape[0])
        # After the loop `running` holds G at each row's first valid token: G_0.
        centred = zero_padding(returns - _group_mean(running, g).unsqueeze(-1), m)
    return masked_whiten(centred, m), returns


# ------------------------------------------------------------------ registry / dispatch


class AdvantageResult(NamedTuple):
    advantages: torch.Tensor  # [B, T], 0 at padding
    returns: torch.Tensor | None  # [B, T] critic / return targets; None if not defined


@dataclass(frozen=True)
class EstimatorSpec:
    """One advantage estimator: THE table entry every other layer derives from (the
    `advantages` driver op's checks and options, the step-logic compiler's functions and
    defaults). `inputs` are the tensor fields `fn` reads besides `mask`."""

    name: str
    needs_values: bool  # reads critic `values` [B, T]: a critic must exist
    needs_groups: bool  # reads `group_index` [B]: compares the samples of one prompt
    returns: bool  # defines `returns` [B, T] (the critic's / return targets)
    inputs: tuple[str, ...]  # "token_rewards" | "scores" | "values" | "group_index"
    options: tuple[str, ...]  # keyword options `fn` accepts
    doc: str  # one line, shown by the step-logic compiler
    fn: Callable[[dict[str, Any], dict[str, Any]], AdvantageResult]  # (fields, options)

    @property
    def needs_critic(self) -> bool:
        """The values come from a critic (the same fact as `needs_values`)."""
        return self.needs_values


def _run_gae(f: dict[str, Any], o: dict[str, Any]) -> AdvantageResult:
    return AdvantageResult(*gae(f["token_rewards"], f["values"], f["mask"], **o))


def _run_grpo(f: dict[str, Any], o: dict[str, Any]) -> AdvantageResult:
    return AdvantageResult(grpo_advantages(f["scores"], f["group_index"], f["mask"], **o), None)


def _run_dr_grpo(f: dict[str, Any], o: dict[str, Any]) -> AdvantageResult:
    return AdvantageResult(
        grpo_advantages(f["scores"], f["group_index"], f["mask"], norm_std=False, **o), None
    )


def _run_rloo(f: dict[str, Any], o: dict[str, Any]) -> AdvantageResult:
    return AdvantageResult(rloo(f["scores"], f["group_index"], f["mask"], **o), None)


def _run_rpp(f: dict[str, Any], o: dict[str, Any]) -> AdvantageResult:
    return AdvantageResult(*reinforce_pp(f["token_rewards"], f["mask"], **o))


def _run_rpp_baseline(f: dict[str, Any], o: dict[str, Any]) -> AdvantageResult:
    return AdvantageResult(
        *reinforce_pp(f["token_rewards"], f["mask"], group_index=f["group_index"], **o)
    )


# Each estimator is named exactly once, here; ADVANTAGE_ESTIMATORS is keyed by `name`.
_SPECS = (
    EstimatorSpec(
        name="gae",
        needs_values=True,
        needs_groups=False,
        returns=True,
        inputs=("token_rewards", "values"),
        options=("gamma", "lam", "whiten"),
        doc="GAE advantages",
        fn=_run_gae,
    ),
    EstimatorSpec(
        name="grpo",
        needs_values=False,
        needs_groups=True,
        returns=False,
        inputs=("scores", "group_index"),
        options=("norm_std", "eps"),
        doc="GRPO group advantages",
        fn=_run_grpo,
    ),
    EstimatorSpec(
        name="dr_grpo",
        needs_values=False,
        needs_groups=True,
        returns=False,
        inputs=("scores", "group_index"),
        options=(),
        doc="Dr. GRPO advantages: s_i - mean_g, no std division (Liu et al. 2025)",
        fn=_run_dr_grpo,
    ),
    EstimatorSpec(
        name="reinforce_pp",
        needs_values=False,
        needs_groups=False,
        returns=True,
        inputs=("token_rewards",),
        options=("gamma",),
        doc="REINFORCE++",
        fn=_run_rpp,
    ),
    EstimatorSpec(
        name="reinforce_pp_baseline",
        needs_values=False,
        needs_groups=True,
        returns=True,
        inputs=("token_rewards", "group_index"),
        options=("gamma",),
        doc="REINFORCE++ with a group-mean baseline",
        fn=_run_rpp_baseline,
    ),
    EstimatorSpec(
        name="rloo",
        needs_values=False,
        needs_groups=True,
        returns=False,
        inputs=("scores", "group_index"),
        options=(),
        doc="RLOO leave-one-out advantages",
        fn=_run_rloo,
    ),
)
ADVANTAGE_ESTIMATORS: dict[str, EstimatorSpec] = {s.name: s for s in _SPECS}

_ALL_OPTIONS = frozenset(o for s in ADVANTAGE_ESTIMATORS.values() for o in s.options)


def compute_advantages(
    name: str,
    *,
    mask: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    **options: Any,
) -> AdvantageResult:
    """Run estimator `name` (a key of ADVANTAGE_ESTIMATORS) on the given fields.

    Give rewards as either `token_rewards` [B, T] or `scores` [B], not both; each is
    converted to what the estimator reads (scores go on the last valid token; token
    rewards are summed over valid tokens into a score). `values` [B, T] is needed when
    the spec says `needs_values`, `group_index` [B] when it says `needs_groups`.
    `options` (gamma, lam, whiten, norm_std, eps) may be a whole algorithm config:
    an option another estimator uses is ignored here, an option no estimator knows
    raises (typos fail loudly).
    """
    spec = ADVANTAGE_ESTIMATORS.get(name)
    if spec is None:
        raise AlgorithmInputError(
            f"compute_advantages: unknown estimator {name!r}; choose one of "
            f"{sorted(ADVANTAGE_ESTIMATORS)}"
        )
    unknown = sorted(set(options) - _ALL_OPTIONS)
    if unknown:
        raise AlgorithmInputError(
            f"compute_advantages({name}): unknown options {unknown}; known: {sorted(_ALL_OPTIONS)}"
        )
    if (token_rewards is None) == (scores is None):
        raise AlgorithmInputError(
            f"compute_advantages({name}): give exactly one of token_rewards [B, T] or scores [B]"
        )
    fields: dict[str, Any] = {"mask": mask, "values": values, "group_index": group_index}
    if "scores" in spec.inputs:
        fields["scores"] = scores if scores is not None else masked_sum(token_rewards, mask, dim=-1)
    else:
        fields["token_rewards"] = (
            token_rewards if token_rewards is not None else place_on_last_token(scores, mask)
        )
    for field in spec.inputs:
        if fields.get(field) is None:
            raise AlgorithmInputError(f"compute_advantages({name}): needs `{field}`")
    chosen = {k: v for k, v in options.items() if k in spec.options}
    return spec.fn(fields, chosen)

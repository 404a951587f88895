"""hybridflow.algos: the RL math, as pure torch functions on [B, T] tensors with masks.

No process, config or transport code here: every function takes tensors and numbers and
returns tensors (and detached stats), so stages call them and tests check them on
hand-computed values. Modules:

- `utils`      masked sum / mean / var / whiten, `place_on_last_token`
- `advantages` GAE, GRPO, REINFORCE++ (+ group baseline), RLOO; `compute_advantages`
- `kl`         k1/k2/k3/abs and straight-through k1+/k3+ estimators, fixed/adaptive coefficient, reward penalty, loss term
- `losses`     loss aggregation modes (incl. Dr. GRPO's seq-mean-token-sum-norm),
               policy losses PPO clip (+ dual-clip), GSPO, CISPO; value loss,
               entropy and log-probs from logits
- `correction` rollout-vs-actor importance weights: TIS (token, truncated), MIS
               (sequence, masked)
- `shaping`    DAPO's overlong reward shaping and dynamic sampling's group filter

Conventions: B sequences, T response positions, V vocabulary; `mask` [B, T] is nonzero
at response tokens that count. Padding never influences any output, gradient or stat.
Malformed input raises `hybridflow.errors.AlgorithmInputError`.
"""

from hybridflow.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageResult,
    EstimatorOptions,
    EstimatorSpec,
    compute_advantages,
    gae,
    grpo_advantages,
    reinforce_pp,
    rloo,
)
from hybridflow.algos.correction import CORRECTION_MODES, Correction, rollout_correction
from hybridflow.algos.kl import (
    KL_ALIASES,
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_estimate,
    kl_loss,
    make_kl_controller,
)
from hybridflow.algos.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    aggregate,
    cispo_policy_loss,
    entropy_bonus,
    entropy_from_logits,
    gspo_policy_loss,
    logprobs_from_logits,
    policy_loss,
    ppo_policy_loss,
    value_loss,
)
from hybridflow.algos.shaping import informative_groups, overlong_penalty
from hybridflow.algos.utils import (
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    place_on_last_token,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "CORRECTION_MODES",
    "KL_ALIASES",
    "KL_KINDS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageResult",
    "Correction",
    "EstimatorOptions",
    "EstimatorSpec",
    "FixedKLController",
    "aggregate",
    "apply_kl_penalty",
    "cispo_policy_loss",
    "compute_advantages",
    "entropy_bonus",
    "entropy_from_logits",
    "gae",
    "grpo_advantages",
    "gspo_policy_loss",
    "informative_groups",
    "kl_estimate",
    "kl_loss",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "place_on_last_token",
    "policy_loss",
    "ppo_policy_loss",
    "reinforce_pp",
    "rloo",
    "rollout_correction",
    "value_loss",
]

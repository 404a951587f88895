"""hybridflow.algos: the RL math, as pure torch functions on [B, T] tensors with masks.

No process, config or transport code here: every function takes tensors and numbers and
returns tensors (and detached stats), so stages call them and tests check them on
hand-computed values. Modules:

- `utils`      masked sum / mean / var / whiten, `place_on_last_token`
- `advantages` GAE, GRPO, REINFORCE++ (+ group baseline), RLOO; `compute_advantages`
- `kl`         k1/k2/k3 estimators, fixed/adaptive coefficient, reward penalty, loss term
- `losses`     loss aggregation modes, PPO clip (+ dual-clip) loss, value loss,
               entropy and log-probs from logits

Conventions: B sequences, T response positions, V vocabulary; `mask` [B, T] is nonzero
at response tokens that count. Padding never influences any output, gradient or stat.
Malformed input raises `hybridflow.errors.AlgorithmInputError`.
"""

from hybridflow.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageResult,
    EstimatorSpec,
    compute_advantages,
    gae,
    grpo_advantages,
    reinforce_pp,
    rloo,
)
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
    aggregate,
    entropy_bonus,
    entropy_from_logits,
    logprobs_from_logits,
    ppo_policy_loss,
    value_loss,
)
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
    "KL_ALIASES",
    "KL_KINDS",
    "AdaptiveKLController",
    "AdvantageResult",
    "EstimatorSpec",
    "FixedKLController",
    "aggregate",
    "apply_kl_penalty",
    "compute_advantages",
    "entropy_bonus",
    "entropy_from_logits",
    "gae",
    "grpo_advantages",
    "kl_estimate",
    "kl_loss",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "place_on_last_token",
    "ppo_policy_loss",
    "reinforce_pp",
    "rloo",
    "value_loss",
]

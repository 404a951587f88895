"""The policy loss of a step logic, resolved: the estimator that makes its advantages and
that estimator's options, the score it reads, the critic values it needs, where its KL
goes (PPO: a penalty in the reward, inside the `advantages` op; GRPO: a term of the actor
loss) and which of its options become actor / critic options.

    actor.update(loss)  ->  loss = ppo_loss(...) | grpo_loss(...)  ->  PolicyLoss

Consumes a StepIR (frontend.analyze); produces a `PolicyLoss` that lowering.py turns into
the `advantages` op and the updates. Which estimator needs critic values or groups, and
which options it takes, is read from hybridflow.algos' ADVANTAGE_ESTIMATORS; the values
of options the logic leaves unset are the `advantages` op's own (AdvantageParams).
Raises CompileError for what is well-typed but has no meaning (estimator= beside
advantages computed on their own line, GAE without a critic, a critic.update that no
GAE feeds, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.algos.advantages import ADVANTAGE_ESTIMATORS, EstimatorSpec
from hybridflow.algos.kl import KL_ALIASES, KL_KINDS
from hybridflow.errors import CompileError
from hybridflow.pipeline.compiler.grammar import (
    ACTOR_LOSS_OPTIONS,
    ESTIMATOR_OPTIONS,
    GRPO_KL_OPTIONS,
    PPO_KL_OPTIONS,
    SHAPING_OPTIONS,
)
from hybridflow.pipeline.compiler.ir import KL, Apply, Arith, Call, Penalty, Scalar, StepIR, Value
from hybridflow.pipeline.driver.rl_ops import AdvantageParams

# Estimator options a compiled step writes out even when the logic leaves them unset, so
# its topology shows what it runs with (the bundled presets write them too). The values
# are the `advantages` op's own defaults (AdvantageParams, whose estimator options are
# hybridflow.algos.EstimatorOptions): one default for YAML and compiled logic alike.
WRITTEN_OPTIONS = ("gamma", "lam", "whiten", "norm_std")
# The KL penalty in the reward that `ppo_loss(score, kl)` means when the logic gives no
# kl_coef: this coefficient, adaptive toward this KL (the `ppo` preset's values).
PPO_KL = {"kl_coef": 0.05, "kl_target": 0.1}
GRPO_KL_COEF = 0.01  # KL as an actor loss term; the `grpo` preset uses the same value


@dataclass(frozen=True)
class RewardPenalty:
    """PPO: KL in the reward, inside the advantages op."""

    kl: KL
    kl_coef: float
    kl_target: float | None  # None: a fixed coefficient


@dataclass(frozen=True)
class LossKL:
    """GRPO: KL as a term of the actor loss."""

    kl: KL
    coef: float


@dataclass(frozen=True)
class PolicyLoss:
    """The actor's policy loss, resolved: the estimator, its inputs and the KL's place."""

    fn: str  # ppo_loss | grpo_loss
    line: int
    spec: EstimatorSpec
    adv_params: dict[str, Scalar]
    score: Value  # the reward score (or an Arith value derived from it)
    values: Value | None  # critic values the estimator reads
    implicit_values: bool  # the estimator needs values no logic line asked for
    penalty: RewardPenalty | None = None
    loss_kl: LossKL | None = None
    score_key: str = "rewards"  # the runtime value holding the scores
    actor_options: dict[str, Scalar] = field(default_factory=dict)
    critic_options: dict[str, Scalar] = field(default_factory=dict)

    @property
    def critic_update(self) -> bool:
        """A critic that feeds the estimator learns from its returns."""
        return self.spec.needs_values


@dataclass(frozen=True)
class _Estimator:
    """Which estimator makes the advantages, from what, with which logic options."""

    spec: EstimatorSpec
    score: Value
    values: Value | None  # critic values named in the logic
    options: dict[str, Scalar]


def resolve_loss(ir: StepIR) -> PolicyLoss | None:
    """The loss `actor.update` minimizes (None: the step updates nothing)."""
    update = ir.call("actor", "update")
    critic_call = ir.call("critic", "update")
    if update is None:
        if critic_call is not None:
            raise CompileError(
                critic_call.line,
                "critic.update without actor.update: the critic only serves the policy",
            )
        return None
    loss_value = ir.resolve(update.args[0])
    apply = ir.definition(loss_value)
    assert isinstance(apply, Apply)  # policy_loss values come from ppo_loss / grpo_loss
    opts, line = dict(apply.options), loss_value.line
    shaping = {k: opts.pop(k) for k in SHAPING_OPTIONS if k in opts}
    kl_value = ir.resolve(apply.args[1]) if len(apply.args) > 1 else None
    est = _estimator(ir, apply, opts, line)
    values, implicit_values = _critic_values(ir, est, line)
    adv_params = _advantage_params(ir, est, shaping, line)
    kl_opts = {k: opts.pop(k) for k in (*PPO_KL_OPTIONS, *GRPO_KL_OPTIONS) if k in opts}
    score, penalty, loss_kl = _kl_place(ir, apply, est.score, kl_value, kl_opts, line)
    return PolicyLoss(
        fn=apply.fn,
        line=line,
        spec=est.spec,
        adv_params=adv_params,
        score=score,
        values=values,
        implicit_values=implicit_values,
        penalty=penalty,
        loss_kl=loss_kl,
        score_key=_score_key(ir, score, line),
        actor_options={k: v for k, v in opts.items() if k in ACTOR_LOSS_OPTIONS},
        critic_options=_critic_options(ir, critic_call, est.spec),
    )


def _estimator(ir: StepIR, apply: Apply, opts: dict[str, Scalar], line: int) -> _Estimator:
    """Advantages computed on their own line (`gae(...)`, `grpo(...)`), or estimated by
    the loss from a score: `estimator=`, else GRPO for grpo_loss, GAE with a critic and
    REINFORCE++ without. Pops the estimator options from `opts`."""
    first = ir.resolve(apply.args[0])
    if first.kind == "advantages":
        adv = ir.definition(first)
        assert isinstance(adv, Apply) and adv.fn in ADVANTAGE_ESTIMATORS
        if "estimator" in opts:
            raise ir.error(line, "estimator= conflicts with advantages computed on their own line")
        spec = ADVANTAGE_ESTIMATORS[adv.fn]
        values = ir.resolve(adv.args[1]) if spec.needs_values else None
        return _Estimator(spec, ir.resolve(adv.args[0]), values, dict(adv.options))
    own = {k: opts.pop(k) for k in ESTIMATOR_OPTIONS if k in opts}
    if apply.fn == "grpo_loss":
        default = "grpo"
    else:
        default = "gae" if "critic" in ir.roles else "reinforce_pp"
    name = str(opts.pop("estimator", default))
    if name not in ADVANTAGE_ESTIMATORS:
        raise ir.error(
            line, f"estimator= must be one of {', '.join(ADVANTAGE_ESTIMATORS)}, got {name!r}"
        )
    return _Estimator(ADVANTAGE_ESTIMATORS[name], first, None, own)


def _critic_values(ir: StepIR, est: _Estimator, line: int) -> tuple[Value | None, bool]:
    """-> (the critic values the estimator reads, whether no logic line asked for them)."""
    spec = est.spec
    if not spec.needs_values or est.values is not None:
        return est.values, False
    if "critic" not in ir.roles:
        others = "/".join(repr(n) for n, s in ADVANTAGE_ESTIMATORS.items() if not s.needs_values)
        raise ir.error(
            line, f"{spec.name.upper()} needs a critic (df.add_critic); or use estimator={others}"
        )
    values = next((v for v in ir.values.values() if v.kind == "values"), None)
    return values, values is None


def _advantage_params(
    ir: StepIR, est: _Estimator, shaping: dict[str, Scalar], line: int
) -> dict[str, Scalar]:
    """The `advantages` op's params: the estimator, its written options (the op's
    defaults where the logic says nothing), the logic's options, DAPO's shaping."""
    spec = est.spec
    unknown = [k for k in est.options if k not in spec.options]
    if unknown:
        raise ir.error(line, f"option {unknown[0]}= does not apply to the {spec.name} estimator")
    if shaping.get("dynamic_sampling") and not spec.needs_groups:
        raise ir.error(
            line,
            f"dynamic_sampling= drops groups whose rewards agree: the {spec.name} "
            "estimator has no groups (use grpo_loss or a group estimator)",
        )
    defaults = AdvantageParams()
    written = {k: getattr(defaults, k) for k in spec.options if k in WRITTEN_OPTIONS}
    return {"estimator": spec.name, **written, **est.options, **shaping}


def _kl_place(
    ir: StepIR,
    apply: Apply,
    score: Value,
    kl_value: Value | None,
    kl_opts: dict[str, Scalar],
    line: int,
) -> tuple[Value, RewardPenalty | None, LossKL | None]:
    """Where the KL goes: a penalty the score already carries (`score - c * kl`), a
    penalty in the reward (ppo_loss's KL argument: adaptive unless kl_coef= fixes it),
    or a term of the actor loss (grpo_loss's). `kl_opts` are the loss's KL options
    (grammar.PPO_KL_OPTIONS / GRPO_KL_OPTIONS). -> (the score before any penalty, ...)."""
    score_def = ir.definition(score)
    if kl_opts and kl_value is None:
        key = next(iter(kl_opts))
        if isinstance(score_def, Penalty):
            why = f"{score.name} already carries its KL penalty: set its coefficient there"
        else:
            why = f"this loss has none; pass the KL: {apply.fn}(score, kl, {key}=...)"
        raise ir.error(line, f"{key}= applies to the loss's KL argument, and {why}")
    if isinstance(score_def, Penalty):
        if kl_value is not None:
            raise ir.error(line, "the score already carries a KL penalty; pass no KL to the loss")
        coef = PPO_KL["kl_coef"] if score_def.coef is None else score_def.coef
        penalty = RewardPenalty(_kl(ir, score_def.kl), float(coef), None)
        return ir.resolve(score_def.score), penalty, None
    if kl_value is None:
        return score, None, None
    kl = _kl(ir, kl_value)
    if apply.fn == "ppo_loss":
        _same_kind(ir, line, "kl_penalty", kl_opts, kl)
        kl_coef = _number(ir, line, "kl_coef", kl_opts.get("kl_coef", PPO_KL["kl_coef"]))
        target = None if "kl_coef" in kl_opts else PPO_KL["kl_target"]
        return score, RewardPenalty(kl, kl_coef, target), None
    _same_kind(ir, line, "kl_loss_type", kl_opts, kl)
    coef = _number(ir, line, "kl_loss_coef", kl_opts.get("kl_loss_coef", GRPO_KL_COEF))
    return score, None, LossKL(kl, coef)


def _same_kind(ir: StepIR, line: int, key: str, kl_opts: dict[str, Scalar], kl: KL) -> None:
    """A KL-kind option of the loss must name the KL argument's own estimator."""
    if key not in kl_opts:
        return
    given = kl_opts[key]
    kind = KL_ALIASES.get(given, given) if isinstance(given, str) else given
    if kind not in KL_KINDS:
        raise ir.error(line, f"{key}= must be one of {', '.join(KL_KINDS)}, got {given!r}")
    if kind != kl.estimator:
        raise ir.error(
            line,
            f"{key}={given!r} disagrees with {kl.result.name}, a {kl.estimator} KL (line "
            f"{kl.line}); choose the estimator where the KL is made: kl(..., kind=...)",
        )


def _score_key(ir: StepIR, score: Value, line: int) -> str:
    """The runtime value holding the scores: `rewards`, or a derived score's own name."""
    score_def = ir.definition(score)
    if isinstance(score_def, Arith):
        return score.name
    if score.kind != "score" or not isinstance(score_def, Call):
        raise ir.error(line, f"{score.name} is not a reward score a loss can use")
    return "rewards"


def _critic_options(ir: StepIR, critic_call: Call | None, spec: EstimatorSpec) -> dict[str, Scalar]:
    """critic.update learns from GAE returns; its value_loss options are the critic's."""
    if critic_call is None:
        return {}
    if not spec.needs_values:
        raise ir.error(
            critic_call.line,
            f"critic.update learns from GAE returns, but the policy loss uses the "
            f"{spec.name} estimator; use gae(...) advantages or drop critic.update",
        )
    crit_def = ir.definition(ir.resolve(critic_call.args[0]))
    if isinstance(crit_def, Apply) and "cliprange_value" in crit_def.options:
        return {"cliprange_value": crit_def.options["cliprange_value"]}
    return {}


def _number(ir: StepIR, line: int, name: str, value: Scalar) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ir.error(line, f"{name}= must be a number, got {value!r}")


def _kl(ir: StepIR, value: Value) -> KL:
    d = ir.definition(ir.resolve(value))
    assert isinstance(d, KL)  # kind `kl` values are made by KL only
    return d

"""Lowering: the typed IR of a checked step logic (ir.StepIR) -> Topology dataflow ops.

Consumes a StepIR (frontend.analyze) and nothing else of the frontend; produces a
CompiledStep. Which estimator needs critic values or groups, and which options it takes,
is read from hybridflow.algos' ADVANTAGE_ESTIMATORS.

The shapes produced are the bundled presets' (grpo/ppo), so a logic that says what a
preset does compiles to that preset's op list:
  - rollout.generate(prompt_ids, prompt_mask) -> response_ids, response_mask,
    rollout_logprobs; the sampler's log-probs stand for `actor.get_logprob` (hybrid
    engine: same weights; an explicit actor.get_logprob op only with top-k/top-p);
  - scoring ops in one role order (reward, reference, actor, critic), each reading only
    the sequences, so they run concurrently once `response` exists;
  - the `advantages` driver op (GRPO / GAE / RLOO / REINFORCE++; PPO's KL as a penalty
    inside it), then actor.update (+ critic.update with GAE) per micro-batch;
  - behind the step barrier: optimizer steps, then actor.reshard.
GRPO's KL becomes actor options (kl_loss_coef, kl_loss_type); sampling keywords of
generate become rollout options, `n` the data source's samples_per_prompt. The loss's
`policy_loss=` (ppo | gspo | cispo), `loss_agg_mode=`, `loss_norm_len=` become actor
options; DAPO's `dynamic_sampling=` and `overlong_*=` become `advantages` params, and
dynamic sampling adds its `sample_mask` (advantages -> actor.update).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridflow.algos.advantages import ADVANTAGE_ESTIMATORS, EstimatorSpec
from hybridflow.config.fields import FIELDS, GENERATE_INPUTS, GENERATE_OUTPUTS, METADATA
from hybridflow.config.fields import SEQUENCE_FIELDS as SEQ
from hybridflow.config.schema import DRIVER_ROLE, OpConfig
from hybridflow.errors import CompileError
from hybridflow.pipeline.compiler.grammar import (
    DATA_FIELDS,
    ESTIMATOR_OPTIONS,
    KINDS,
    SHAPING_OPTIONS,
)
from hybridflow.pipeline.compiler.ir import (
    KL,
    Apply,
    Arith,
    Call,
    CompiledStep,
    Penalty,
    Scalar,
    StepIR,
    StepOutput,
    Value,
)
from hybridflow.pipeline.driver.rl_ops import AdvantageParams


def lower(ir: StepIR) -> CompiledStep:
    """The dataflow of a checked step logic; CompileError for what is well-typed but has
    no dataflow (no generate, a critic update without GAE, ...)."""
    return _Lowering(ir).run()


# Estimator options a compiled step writes out even when the logic leaves them unset, so
# its topology shows what it runs with (the bundled presets write them too). The values
# are the `advantages` op's own defaults (AdvantageParams, whose estimator options are
# hybridflow.algos.EstimatorOptions): one default for YAML and compiled logic alike.
WRITTEN_OPTIONS = ("gamma", "lam", "whiten", "norm_std")
# The KL penalty in the reward that `ppo_loss(score, kl)` means when the logic gives no
# kl_coef: this coefficient, adaptive toward this KL (the `ppo` preset's values).
PPO_KL = {"kl_coef": 0.05, "kl_target": 0.1}
GRPO_KL_COEF = 0.01  # KL as an actor loss term; the `grpo` preset uses the same value
DEFAULT_GROUP_SIZE = 8  # samples per prompt for group estimators when generate says no n
_ROLLOUT_OPTIONS = ("temperature", "top_p", "top_k", "max_new_tokens")
_ACTOR_LOSS_OPTIONS = {
    "clip_ratio": "clip_ratio_low",
    "clip_ratio_low": "clip_ratio_low",
    "clip_ratio_high": "clip_ratio_high",
    "dual_clip_c": "dual_clip_c",
    "entropy_coef": "entropy_coef",
    "policy_loss": "policy_loss",
    "loss_agg_mode": "loss_agg_mode",
    "loss_norm_len": "loss_norm_len",
}
ARITH_OP = "hybridflow.pipeline.driver.expr:arith"
SCORE_ADV_OP = "hybridflow.pipeline.driver.expr:ScoreAdvantages"


@dataclass(frozen=True)
class _Penalty:
    """PPO: KL in the reward, inside the advantages op."""

    kl: KL
    kl_coef: float
    kl_target: float | None  # None: a fixed coefficient


@dataclass(frozen=True)
class _LossKL:
    """GRPO: KL as a term of the actor loss."""

    kl: KL
    coef: float


@dataclass(frozen=True)
class _Loss:
    """The actor's policy loss, resolved: the estimator, its inputs and the KL's place."""

    fn: str  # ppo_loss | grpo_loss
    line: int
    spec: EstimatorSpec
    adv_params: dict[str, Scalar]
    score: Value  # the reward score (or an Arith value derived from it)
    values: Value | None  # critic values the estimator reads
    implicit_values: bool  # the estimator needs values no logic line asked for
    penalty: _Penalty | None = None
    loss_kl: _LossKL | None = None
    score_key: str = "rewards"  # the runtime value holding the scores
    actor_options: dict[str, Scalar] = field(default_factory=dict)
    critic_options: dict[str, Scalar] = field(default_factory=dict)

    @property
    def critic_update(self) -> bool:
        """A critic that feeds the estimator learns from its returns."""
        return self.spec.needs_values


class _Lowering:
    def __init__(self, ir: StepIR) -> None:
        self.ir = ir
        self.role_options: dict[str, dict[str, Any]] = {}
        self.data_options: dict[str, Any] = {}
        self.old_key = "rollout_logprobs"

    def opt(self, role: str, **kv: Any) -> None:
        self.role_options.setdefault(role, {}).update(kv)

    def run(self) -> CompiledStep:
        ir = self.ir
        gen = ir.call("rollout", "generate")
        if gen is None:
            raise CompileError(
                0, "the logic never generates: start with `response = actor.generate(prompt)`"
            )
        gen_opts = dict(gen.params)
        for key in _ROLLOUT_OPTIONS:
            if key in gen_opts:
                self.opt("rollout", **{key: gen_opts[key]})
        # Truncated sampling (top-k/top-p) changes the sampler's log-probs: then the
        # actor's own log-probs are computed by an actor.get_logprob op.
        truncated = gen_opts.get("top_k") not in (None, 0) or gen_opts.get("top_p") not in (
            None,
            1,
            1.0,
        )
        self.old_key = "old_logprobs" if truncated else "rollout_logprobs"
        loss = self._policy_loss()
        group = loss is not None and loss.spec.needs_groups
        n = gen_opts.get("n")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ir.error(gen.line, f"n= must be an int >= 1 (samples per prompt), got {n!r}")
        if loss is not None and group:
            n = DEFAULT_GROUP_SIZE if n is None else n
            if n < 2:
                raise ir.error(
                    gen.line, f"{loss.fn} compares the samples of a prompt: n= must be >= 2"
                )
        self.data_options["samples_per_prompt"] = n or 1

        ops: list[OpConfig] = [
            OpConfig("rollout", "generate", GENERATE_INPUTS, GENERATE_OUTPUTS, phase="rollout")
        ]
        fields = [*DATA_FIELDS, *(["group_index"] if group else [])]
        arith = self._emitted_arith(loss)
        need = self._needed(loss, arith)
        if "reward" in need:
            ops.append(
                OpConfig(
                    "reward",
                    "score",
                    (*SEQ, METADATA, *(("group_index",) if group else ())),
                    ("rewards",),
                    phase="reward",
                )
            )
        if "reference" in need:
            ops.append(OpConfig("reference", "get_logprob", SEQ, ("ref_logprobs",), phase="ref"))
        if "actor_logprob" in need and truncated:
            ops.append(OpConfig("actor", "get_logprob", SEQ, ("old_logprobs",), phase="logprob"))
        if "critic" in need:
            ops.append(OpConfig("critic", "values", SEQ, ("values",), phase="values"))
        ops += [self._arith_op(a) for a in arith]  # arithmetic the step reports or a loss reads
        if loss is not None:
            ops += self._training_ops(loss, group)
        outputs, collect = self._outputs(ops, fields)
        return CompiledStep(
            dataflow=tuple(ops),
            data_fields=tuple(fields),
            role_options={**self.role_options, "data": self.data_options},
            outputs=outputs,
            collect=collect,
            values={name: v.kind for name, v in ir.values.items()},
        )

    # -- the policy loss, resolved --------------------------------------------------------
    def _policy_loss(self) -> _Loss | None:
        ir = self.ir
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
        fn, args, opts = apply.fn, apply.args, dict(apply.options)
        line = loss_value.line
        shaping = {k: opts.pop(k) for k in SHAPING_OPTIONS if k in opts}
        first = ir.resolve(args[0])
        kl_value = ir.resolve(args[1]) if len(args) > 1 else None
        values: Value | None = None
        if first.kind == "advantages":
            adv = ir.definition(first)
            assert isinstance(adv, Apply) and adv.fn in ADVANTAGE_ESTIMATORS
            spec = ADVANTAGE_ESTIMATORS[adv.fn]
            adv_opts = dict(adv.options)
            score = ir.resolve(adv.args[0])
            if spec.needs_values:
                values = ir.resolve(adv.args[1])
            if "estimator" in opts:
                raise ir.error(
                    line, "estimator= conflicts with advantages computed on their own line"
                )
        else:
            score = first
            adv_opts = {k: opts.pop(k) for k in ESTIMATOR_OPTIONS if k in opts}
            default = (
                "grpo" if fn == "grpo_loss" else ("gae" if "critic" in ir.roles else "reinforce_pp")
            )
            estimator = str(opts.pop("estimator", default))
            if estimator not in ADVANTAGE_ESTIMATORS:
                raise ir.error(
                    line,
                    f"estimator= must be one of {', '.join(ADVANTAGE_ESTIMATORS)}, "
                    f"got {estimator!r}",
                )
            spec = ADVANTAGE_ESTIMATORS[estimator]
        implicit_values = False
        if spec.needs_values and values is None:
            if "critic" not in ir.roles:
                others = "/".join(
                    repr(n) for n, s in ADVANTAGE_ESTIMATORS.items() if not s.needs_values
                )
                raise ir.error(
                    line,
                    f"{spec.name.upper()} needs a critic (df.add_critic); or use "
                    f"estimator={others}",
                )
            values = next((v for v in ir.values.values() if v.kind == "values"), None)
            implicit_values = values is None
        unknown = [k for k in adv_opts if k not in spec.options]
        if unknown:
            raise ir.error(
                line, f"option {unknown[0]}= does not apply to the {spec.name} estimator"
            )
        defaults = AdvantageParams()
        written = {k: getattr(defaults, k) for k in spec.options if k in WRITTEN_OPTIONS}
        adv_params: dict[str, Scalar] = {"estimator": spec.name, **written, **adv_opts}
        if shaping.get("dynamic_sampling") and not spec.needs_groups:
            raise ir.error(
                line,
                f"dynamic_sampling= drops groups whose rewards agree: the {spec.name} "
                "estimator has no groups (use grpo_loss or a group estimator)",
            )
        adv_params |= shaping
        # The score: the reward model's `rewards`, maybe penalised by KL, maybe derived.
        penalty: _Penalty | None = None
        loss_kl: _LossKL | None = None
        score_def = ir.definition(score)
        if isinstance(score_def, Penalty):
            if kl_value is not None:
                raise ir.error(
                    line, "the score already carries a KL penalty; pass no KL to the loss"
                )
            coef = PPO_KL["kl_coef"] if score_def.coef is None else score_def.coef
            penalty = _Penalty(self._kl(score_def.kl), float(coef), None)
            score = ir.resolve(score_def.score)
        elif kl_value is not None and fn == "ppo_loss":
            kl_coef = self._number(line, "kl_coef", opts.pop("kl_coef", PPO_KL["kl_coef"]))
            fixed = "kl_coef" in apply.options
            penalty = _Penalty(self._kl(kl_value), kl_coef, None if fixed else PPO_KL["kl_target"])
        elif kl_value is not None:  # grpo_loss: KL as a loss term of the actor
            coef = self._number(line, "kl_coef", opts.pop("kl_coef", GRPO_KL_COEF))
            loss_kl = _LossKL(self._kl(kl_value), coef)
        score_key = "rewards"
        score_def = ir.definition(score)
        if isinstance(score_def, Arith):
            score_key = score.name
        elif score.kind != "score" or not isinstance(score_def, Call):
            raise ir.error(line, f"{score.name} is not a reward score a loss can use")
        for key in ("kl_coef", "kl_type"):
            opts.pop(key, None)
        actor_options = {
            _ACTOR_LOSS_OPTIONS[k]: v for k, v in opts.items() if k in _ACTOR_LOSS_OPTIONS
        }
        critic_options: dict[str, Scalar] = {}
        if critic_call is not None:
            crit = ir.resolve(critic_call.args[0])
            if not spec.needs_values:
                raise ir.error(
                    critic_call.line,
                    f"critic.update learns from GAE returns, but the policy loss uses the "
                    f"{spec.name} estimator; use gae(...) advantages or drop critic.update",
                )
            crit_def = ir.definition(crit)
            if isinstance(crit_def, Apply) and "cliprange_value" in crit_def.options:
                critic_options["cliprange_value"] = crit_def.options["cliprange_value"]
        return _Loss(
            fn=fn,
            line=line,
            spec=spec,
            adv_params=adv_params,
            score=score,
            values=values,
            implicit_values=implicit_values,
            penalty=penalty,
            loss_kl=loss_kl,
            score_key=score_key,
            actor_options=actor_options,
            critic_options=critic_options,
        )

    def _number(self, line: int, name: str, value: Scalar) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise self.ir.error(line, f"{name}= must be a number, got {value!r}")

    def _kl(self, value: Value) -> KL:
        d = self.ir.definition(self.ir.resolve(value))
        assert isinstance(d, KL)  # kind `kl` values are made by KL only
        return d

    def _emitted_arith(self, loss: _Loss | None) -> list[Arith]:
        """Arith values that become driver ops: those the step reports and the score a
        loss reads, in line order."""
        ir = self.ir
        wanted = {ir.resolve(v).name for n, v in ir.values.items() if n in ir.outputs}
        if loss is not None and loss.score_key != "rewards":
            wanted.add(loss.score_key)
        return [a for a in ir.assigns.values() if isinstance(a, Arith) and a.result.name in wanted]

    def _needed(self, loss: _Loss | None, arith: list[Arith]) -> set[str]:
        ir = self.ir
        need = {c.role for c in ir.calls if c.op != "update"}
        if ir.call("actor", "get_logprob") is not None:
            need.add("actor_logprob")
        need.discard("actor")
        if loss is not None:
            need.add("reward")
            if loss.values is not None or loss.implicit_values:
                need.add("critic")
            if loss.penalty is not None or loss.loss_kl is not None:
                need |= {"reference", "actor_logprob"}
        for a in arith:
            for v in a.args:
                k = ir.resolve(v).kind
                if k == "ref_logprob":
                    need.add("reference")
                if k == "actor_logprob":
                    need.add("actor_logprob")
        return need

    def _training_ops(self, loss: _Loss, group: bool) -> list[OpConfig]:
        ir = self.ir
        for key, value in loss.actor_options.items():
            self.opt("actor", **{key: value})
        for key, value in loss.critic_options.items():
            self.opt("critic", **{key: value})
        has_ref = "reference" in ir.roles and (
            ir.call("reference", "get_logprob") is not None
            or loss.penalty is not None
            or loss.loss_kl is not None
        )
        critic = loss.critic_update
        params: dict[str, Scalar] = dict(loss.adv_params)
        inputs = [loss.score_key, "response_mask"]
        if group:
            inputs.append("group_index")
        inputs.append("prompt_mask")
        if critic:
            inputs.append("values")
        if loss.penalty is not None:
            pen = loss.penalty
            inputs += [self.old_key, "ref_logprobs"]
            params["kl_penalty"] = pen.kl.estimator
            params["kl_coef"] = pen.kl_coef
            if pen.kl_target is not None:
                params["kl_target"] = pen.kl_target
                params["kl_horizon"] = AdvantageParams.kl_horizon
            if self.old_key != "rollout_logprobs":
                params["old_logprob_key"] = self.old_key
        if loss.score_key != "rewards":
            params["score"] = loss.score_key
        outs = ("advantages", "returns") if critic else ("advantages",)
        dynamic = bool(params.get("dynamic_sampling"))
        if dynamic:
            outs = (*outs, "sample_mask")
        ops = [
            OpConfig(
                DRIVER_ROLE,
                "advantages" if loss.score_key == "rewards" else SCORE_ADV_OP,
                tuple(inputs),
                outs,
                phase="adv",
                params=params,
            )
        ]
        actor_in = [*SEQ, "advantages", self.old_key] + (["ref_logprobs"] if has_ref else [])
        if dynamic:
            actor_in.append("sample_mask")
        ops.append(OpConfig("actor", "update", tuple(actor_in), phase="train"))
        self.opt("actor", old_logprob_key=self.old_key)
        if loss.loss_kl is not None:
            lk = loss.loss_kl
            self.opt("actor", kl_loss_coef=lk.coef, kl_loss_type=lk.kl.estimator)
        else:
            self.opt("actor", kl_loss_coef=0.0)
        if critic:
            ops.append(OpConfig("critic", "update", (*SEQ, "returns", "values"), phase="train"))
        ops.append(OpConfig("actor", "optimizer_step", scope="step", phase="train"))
        if critic:
            ops.append(OpConfig("critic", "optimizer_step", scope="step", phase="train"))
        ops.append(OpConfig("actor", "reshard", scope="step", phase="reshard"))
        return ops

    def _arith_op(self, arith: Arith) -> OpConfig:
        name = arith.result.name
        if name in FIELDS:  # every kind's fields are among them
            raise self.ir.error(
                arith.line, f"{name!r} is a name the runtime uses; pick another value name"
            )
        runtime = {v.name: self._runtime_name(v) for v in arith.args}
        node = _Rename(runtime).visit(ast.parse(arith.expr, mode="eval").body)
        inputs = list(dict.fromkeys(runtime.values()))
        if arith.per_token:
            inputs.append("response_mask")
        return OpConfig(
            DRIVER_ROLE,
            ARITH_OP,
            tuple(inputs),
            (name,),
            phase="expr",
            params={"expr": ast.unparse(node), "output": name},
        )

    def _outputs(
        self, ops: list[OpConfig], fields: list[str]
    ) -> tuple[dict[str, StepOutput], tuple[str, ...]]:
        """Each declared output -> where its value is read once a step has run, and the
        runtime tensors to collect for the per-sample ones. CompileError naming an output
        that no op of `ops` computes (a loss no update minimizes, a KL without an
        actor.update to measure it, advantages no estimator op makes, ...)."""
        ir = self.ir
        values = ir.values
        produced = {*fields, *(o for op in ops for o in op.outputs)}
        actor_update = next((op for op in ops if (op.role, op.op) == ("actor", "update")), None)
        outputs: dict[str, StepOutput] = {}
        collect: list[str] = []
        for name in ir.outputs:
            value = values.get(name)
            if value is None:  # a runtime name (`rewards`): report the value that carries it
                value = next(v for v in values.values() if name in KINDS[v.kind].fields)
            value = ir.resolve(value)
            kind, metric = value.kind, KINDS[value.kind].metric
            if kind == "prompt":
                outputs[name] = StepOutput(kind, "", "")
                continue
            if kind in ("policy_loss", "value_loss", "kl"):
                self._check_step_value(name, value, actor_update)
                outputs[name] = StepOutput(kind, "", metric)
                continue
            tensor = self._runtime_name(value)
            if tensor not in produced:
                raise CompileError(
                    0,
                    f"output {name!r}: {value.name} is never computed by the step's ops "
                    f"(no op produces {tensor!r}); use it in the step or drop it from outputs",
                )
            if isinstance(ir.definition(value), Arith):
                metric = ""
            outputs[name] = StepOutput(kind, tensor, metric)
            collect += [tensor, "response_mask"] if kind == "response" else [tensor]
        return outputs, tuple(dict.fromkeys(collect))

    def _check_step_value(self, name: str, value: Value, actor_update: OpConfig | None) -> None:
        """A loss or a KL exists only inside an update: its value is that update's metric."""
        ir = self.ir
        if value.kind == "kl":
            if actor_update is None or "ref_logprobs" not in actor_update.inputs:
                raise CompileError(
                    0,
                    f"output {name!r}: the KL {value.name} is measured by actor.update "
                    "(metric actor/kl) with the reference's log-probs, and this step has "
                    "no such update; update the actor with a loss that uses it, or drop "
                    "it from outputs",
                )
            return
        role = "actor" if value.kind == "policy_loss" else "critic"
        update = ir.call(role, "update")
        if update is None or ir.resolve(update.args[0]) != value:
            raise CompileError(
                0,
                f"output {name!r}: {value.name} is a loss no update minimizes, so it is "
                f"never computed; pass it to {role}.update(...) or drop it from outputs",
            )

    def _runtime_name(self, value: Value) -> str:
        """The runtime tensor a logic value stands for."""
        value = self.ir.resolve(value)
        if isinstance(self.ir.definition(value), Arith) or value.kind == "tensor":
            return value.name
        if value.kind == "actor_logprob":
            return self.old_key
        fields = KINDS[value.kind].fields
        if not fields:
            raise CompileError(
                value.line, f"{value.name} ({value.kind}) is not a tensor the dataflow carries"
            )
        return fields[0]


class _Rename(ast.NodeTransformer):
    def __init__(self, names: Mapping[str, str]) -> None:
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(id=self.names.get(node.id, node.id), ctx=node.ctx)

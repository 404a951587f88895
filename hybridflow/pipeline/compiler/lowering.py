"""Lowering: the typed IR of a checked step logic (ir.StepIR) -> Topology dataflow ops.

Consumes a StepIR (frontend.analyze) and nothing else of the frontend; produces a
CompiledStep. The policy loss (its estimator and that estimator's options, its score, where
its KL goes) is resolved by loss.py; this module lays the ops out.

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
from typing import Any

from hybridflow.config.fields import FIELDS, GENERATE_INPUTS, GENERATE_OUTPUTS, METADATA
from hybridflow.config.fields import SEQUENCE_FIELDS as SEQ
from hybridflow.config.schema import DRIVER_ROLE, OpConfig
from hybridflow.errors import CompileError
from hybridflow.pipeline.compiler.grammar import DATA_FIELDS, KINDS, ROLE_METHODS
from hybridflow.pipeline.compiler.ir import Arith, CompiledStep, Scalar, StepIR, StepOutput, Value
from hybridflow.pipeline.compiler.loss import PolicyLoss, resolve_loss
from hybridflow.pipeline.driver.rl_ops import AdvantageParams


def lower(ir: StepIR) -> CompiledStep:
    """The dataflow of a checked step logic; CompileError for what is well-typed but has
    no dataflow (no generate, a critic update without GAE, ...)."""
    return _Lowering(ir).run()


DEFAULT_GROUP_SIZE = 8  # samples per prompt for group estimators when generate says no n
# generate's sampling options are the rollout's options of the same names; `n` is the data
# source's samples_per_prompt
_ROLLOUT_OPTIONS = tuple(o for o in ROLE_METHODS[("actor", "generate")].options if o != "n")
ARITH_OP = "hybridflow.pipeline.driver.expr:arith"
SCORE_ADV_OP = "hybridflow.pipeline.driver.expr:ScoreAdvantages"


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
        loss = resolve_loss(ir)
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

    def _emitted_arith(self, loss: PolicyLoss | None) -> list[Arith]:
        """Arith values that become driver ops: those the step reports and the score a
        loss reads, in line order."""
        ir = self.ir
        wanted = {ir.resolve(v).name for n, v in ir.values.items() if n in ir.outputs}
        if loss is not None and loss.score_key != "rewards":
            wanted.add(loss.score_key)
        return [a for a in ir.assigns.values() if isinstance(a, Arith) and a.result.name in wanted]

    def _needed(self, loss: PolicyLoss | None, arith: list[Arith]) -> set[str]:
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

    def _training_ops(self, loss: PolicyLoss, group: bool) -> list[OpConfig]:
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

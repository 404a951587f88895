"""Lowering: the checked, typed values of a step logic -> Topology dataflow ops.

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
generate become rollout options, `n` the data source's samples_per_prompt.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

from hybridflow.config.schema import DRIVER_ROLE, OpConfig
from hybridflow.errors import CompileError
from hybridflow.pipeline.compiler import expr as expr_ops
from hybridflow.pipeline.compiler.grammar import KINDS, CompiledStep, Sym

if TYPE_CHECKING:
    from hybridflow.pipeline.compiler.frontend import _Compiler


def lower(comp: _Compiler) -> CompiledStep:
    return _Lowering(comp).run()


SEQ = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")
_ADV_ALGOS = {"gae": "gae", "grpo": "grpo", "rloo": "rloo", "reinforce_pp": "reinforce_pp"}
_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
_ADV_PARAMS = {  # the params the `advantages` op gets per estimator, with defaults
    "gae": {"gamma": 1.0, "lam": 0.95, "whiten": True},
    "grpo": {"norm_std": True},
    "rloo": {},
    "reinforce_pp": {"gamma": 1.0},
    "reinforce_pp_baseline": {"gamma": 1.0},
}
PPO_KL = {"kl_coef": 0.05, "kl_target": 0.1, "kl_horizon": 10000}  # penalty in the reward
GRPO_KL_COEF = 0.01  # KL as an actor loss term; the `grpo` preset uses the same value
DEFAULT_GROUP_SIZE = 8  # samples per prompt for group estimators when generate says no n
_ROLLOUT_OPTIONS = ("temperature", "top_p", "top_k", "max_new_tokens")
_ACTOR_LOSS_OPTIONS = {
    "clip_ratio": "clip_ratio_low",
    "clip_ratio_low": "clip_ratio_low",
    "clip_ratio_high": "clip_ratio_high",
    "dual_clip_c": "dual_clip_c",
    "entropy_coef": "entropy_coef",
}
ARITH_OP = "hybridflow.pipeline.compiler.expr:arith"
SCORE_ADV_OP = "hybridflow.pipeline.compiler.expr:ScoreAdvantages"


class _Lowering:
    def __init__(self, comp: _Compiler) -> None:
        self.c = comp
        self.role_options: dict[str, dict[str, Any]] = {}
        self.data_options: dict[str, Any] = {}
        self.arith: dict[str, OpConfig] = {}  # arith ops by output name (emitted once)

    def opt(self, role: str, **kv: Any) -> None:
        self.role_options.setdefault(role, {}).update(kv)

    def run(self) -> CompiledStep:
        c = self.c
        gen = c.calls.get(("rollout", "generate"))
        if gen is None:
            raise CompileError(
                0, "the logic never generates: start with `response = actor.generate(prompt)`"
            )
        gen_opts = dict(gen.kwargs)
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
        group = loss is not None and loss["estimator"] in GROUP_ESTIMATORS
        n = gen_opts.get("n")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise self.c.err(gen, f"n= must be an int >= 1 (samples per prompt), got {n!r}")
        if group:
            n = DEFAULT_GROUP_SIZE if n is None else n
            if n < 2:
                raise self.c.err(
                    gen, f"{loss['fn']} compares the samples of a prompt: n= must be >= 2"
                )
        self.data_options["samples_per_prompt"] = n or 1

        ops: list[OpConfig] = [
            OpConfig(
                "rollout",
                "generate",
                ("prompt_ids", "prompt_mask"),
                ("response_ids", "response_mask", "rollout_logprobs"),
                phase="rollout",
            )
        ]
        fields = ["prompt_ids", "prompt_mask", "metadata_json"] + (["group_index"] if group else [])
        need = self._needed(loss)
        if "reward" in need:
            ops.append(
                OpConfig(
                    "reward",
                    "score",
                    (*SEQ, "metadata_json", *(("group_index",) if group else ())),
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
        for sym in c.env.values():  # arithmetic the step reports or a loss reads
            if "expr" in sym.info and (sym.name in c.outputs or sym.info.get("feeds_loss")):
                ops.append(self._arith_op(sym))
        if loss is not None:
            ops += self._training_ops(loss, group)
        outputs, collect = self._outputs()
        return CompiledStep(
            dataflow=tuple(ops),
            data_fields=tuple(fields),
            role_options={**self.role_options, "data": self.data_options},
            outputs=outputs,
            collect=collect,
            values={name: s.kind for name, s in c.env.items()},
        )

    # -- the policy loss, resolved --------------------------------------------------------
    def _policy_loss(self) -> dict[str, Any] | None:
        c = self.c
        sym = c.updates.get("actor")
        if sym is None:
            if "critic" in c.updates:
                raise CompileError(
                    c.calls[("critic", "update")].line,
                    "critic.update without actor.update: the critic only serves the policy",
                )
            return None
        sym = _unalias(sym)
        fn, args, opts = sym.info["fn"], sym.info["args"], dict(sym.info["opts"])
        line = sym.line
        first = _unalias(args[0])
        kl = _unalias(args[1]) if len(args) > 1 else None
        out: dict[str, Any] = {"fn": fn, "line": line, "kl": None, "kl_mode": None}
        values: Sym | None = None
        if first.kind == "advantages":
            adv = first
            estimator = _ADV_ALGOS[adv.info["fn"]]
            adv_opts = dict(adv.info["opts"])
            score = _unalias(adv.info["args"][0])
            if estimator == "gae":
                values = _unalias(adv.info["args"][1])
            if "estimator" in opts:
                raise c.err(line, "estimator= conflicts with advantages computed on their own line")
        else:
            score = first
            adv_opts = {k: opts.pop(k) for k in ("gamma", "lam", "whiten", "norm_std") if k in opts}
            default = (
                "grpo" if fn == "grpo_loss" else ("gae" if "critic" in c.roles else "reinforce_pp")
            )
            estimator = str(opts.pop("estimator", default))
            if estimator not in _ESTIMATORS:
                raise c.err(
                    line, f"estimator= must be one of {', '.join(_ESTIMATORS)}, got {estimator!r}"
                )
        if estimator == "gae" and values is None:
            if "critic" not in c.roles:
                raise c.err(
                    line,
                    "GAE needs a critic (df.add_critic); or use estimator='grpo'/'rloo'/'reinforce_pp'",
                )
            values = next((s for s in c.env.values() if s.kind == "values"), None)
            out["implicit_values"] = values is None
        unknown = [k for k in adv_opts if k not in _ADV_PARAMS[estimator]]
        if unknown:
            raise c.err(line, f"option {unknown[0]}= does not apply to the {estimator} estimator")
        out["adv_params"] = {"estimator": estimator, **_ADV_PARAMS[estimator], **adv_opts}
        out["estimator"] = estimator
        out["values"] = values
        # The score: the reward model's `rewards`, maybe penalised by KL, maybe derived.
        if score.info.get("fn") == "kl_penalty":
            base, pkl = (_unalias(a) for a in score.info["args"])
            if kl is not None:
                raise c.err(line, "the score already carries a KL penalty; pass no KL to the loss")
            coef = score.info["opts"].get("coef", PPO_KL["kl_coef"])
            out["penalty"] = {"kl": pkl, "kl_coef": float(coef), "kl_target": None}
            score = base
        elif kl is not None and fn == "ppo_loss":
            out["penalty"] = {
                "kl": kl,
                "kl_coef": float(opts.pop("kl_coef", PPO_KL["kl_coef"])),
                "kl_target": PPO_KL["kl_target"] if "kl_coef" not in sym.info["opts"] else None,
            }
        elif kl is not None:  # grpo_loss: KL as a loss term of the actor
            out["loss_kl"] = {"kl": kl, "coef": float(opts.pop("kl_coef", GRPO_KL_COEF))}
        if "expr" in score.info:
            score.info["feeds_loss"] = True
            out["score_key"] = score.name
        elif score.kind != "score" or score.info.get("fn") is not None:
            raise c.err(line, f"{score.name} is not a reward score a loss can use")
        out["score"] = score
        for key in ("kl_coef", "kl_type"):
            opts.pop(key, None)
        for key, value in opts.items():
            if key in _ACTOR_LOSS_OPTIONS:
                self.opt("actor", **{_ACTOR_LOSS_OPTIONS[key]: value})
        crit = c.updates.get("critic")
        if crit is not None:
            crit = _unalias(crit)
            if estimator != "gae":
                raise c.err(
                    c.calls[("critic", "update")].line,
                    f"critic.update learns from GAE returns, but the policy loss uses the "
                    f"{estimator} estimator; use gae(...) advantages or drop critic.update",
                )
            if crit.kind == "value_loss":
                cv = crit.info["opts"].get("cliprange_value")
                if "cliprange_value" in crit.info["opts"]:
                    self.opt("critic", cliprange_value=cv)
        out["critic_update"] = estimator == "gae"  # a critic that feeds GAE learns from it
        return out

    def _needed(self, loss: dict[str, Any] | None) -> set[str]:
        c = self.c
        need = {role for (role, op) in c.calls if op != "update"}
        if ("actor", "get_logprob") in c.calls:
            need.add("actor_logprob")
        need.discard("actor")
        if loss is not None:
            need.add("reward")
            if loss.get("values") is not None or loss.get("implicit_values"):
                need.add("critic")
            for key in ("penalty", "loss_kl"):
                if key in loss:
                    need |= {"reference", "actor_logprob"}
        for sym in c.env.values():
            if "expr" in sym.info and (sym.name in c.outputs or sym.info.get("feeds_loss")):
                for a in sym.info["args"]:
                    k = _unalias(a).kind
                    if k == "ref_logprob":
                        need.add("reference")
                    if k == "actor_logprob":
                        need.add("actor_logprob")
        return need

    def _kl_kind(self, kl: Sym) -> str:
        return str(kl.info.get("estimator", "k1"))

    def _training_ops(self, loss: dict[str, Any], group: bool) -> list[OpConfig]:
        c = self.c
        has_ref = "reference" in c.roles and (
            ("reference", "get_logprob") in c.calls or "penalty" in loss or "loss_kl" in loss
        )
        critic = loss["critic_update"]
        params = dict(loss["adv_params"])
        score_key = loss.get("score_key", "rewards")
        inputs = [score_key, "response_mask"]
        if group:
            inputs.append("group_index")
        inputs.append("prompt_mask")
        if critic:
            inputs.append("values")
        if "penalty" in loss:
            pen = loss["penalty"]
            inputs += [self.old_key, "ref_logprobs"]
            params["kl_penalty"] = self._kl_kind(pen["kl"])
            params["kl_coef"] = pen["kl_coef"]
            if pen["kl_target"] is not None:
                params["kl_target"] = pen["kl_target"]
                params["kl_horizon"] = PPO_KL["kl_horizon"]
            if self.old_key != "rollout_logprobs":
                params["old_logprob_key"] = self.old_key
        if score_key != "rewards":
            params["score"] = score_key
        outs = ("advantages", "returns") if critic else ("advantages",)
        ops = [
            OpConfig(
                DRIVER_ROLE,
                "advantages" if score_key == "rewards" else SCORE_ADV_OP,
                tuple(inputs),
                outs,
                phase="adv",
                params=params,
            )
        ]
        actor_in = [*SEQ, "advantages", self.old_key] + (["ref_logprobs"] if has_ref else [])
        ops.append(OpConfig("actor", "update", tuple(actor_in), phase="train"))
        self.opt("actor", old_logprob_key=self.old_key)
        if "loss_kl" in loss:
            lk = loss["loss_kl"]
            self.opt("actor", kl_loss_coef=lk["coef"], kl_loss_type=self._kl_kind(lk["kl"]))
        else:
            self.opt("actor", kl_loss_coef=0.0)
        if critic:
            ops.append(OpConfig("critic", "update", (*SEQ, "returns", "values"), phase="train"))
        ops.append(OpConfig("actor", "optimizer_step", scope="step", phase="train"))
        if critic:
            ops.append(OpConfig("critic", "optimizer_step", scope="step", phase="train"))
        ops.append(OpConfig("actor", "reshard", scope="step", phase="reshard"))
        return ops

    def _arith_op(self, sym: Sym) -> OpConfig:
        runtime = {
            n: _runtime_name(self.c.env[n], self.old_key)
            for n in expr_ops.names_in(sym.info["expr"])
        }
        for name in (sym.name,):
            taken = (
                {f for k in KINDS.values() for f in k.fields}
                | set(SEQ)
                | {"rollout_logprobs", "returns", "group_index", "metadata_json"}
            )
            if name in taken:
                raise self.c.err(
                    sym.line, f"{name!r} is a name the runtime uses; pick another value name"
                )
        node = _Rename(runtime).visit(ast.parse(ast.unparse(sym.info["expr"]), mode="eval").body)
        inputs = list(dict.fromkeys(runtime.values()))
        if sym.info.get("per_token"):
            inputs.append("response_mask")
        return OpConfig(
            DRIVER_ROLE,
            ARITH_OP,
            tuple(inputs),
            (sym.name,),
            phase="expr",
            params={"expr": ast.unparse(node), "output": sym.name},
        )

    def _outputs(self) -> tuple[dict[str, str], tuple[str, ...]]:
        c = self.c
        metrics: dict[str, str] = {}
        collect: list[str] = []
        for name in c.outputs:
            sym = c.env.get(name)
            if sym is None:  # a runtime name (`rewards`): report the value that carries it
                sym = next(s for s in c.env.values() if name in KINDS[s.kind].fields)
            sym = _unalias(sym)
            metric = KINDS[sym.kind].metric
            if "expr" in sym.info:
                metric = ""
            metrics[name] = metric
            if not metric:
                collect.append(_runtime_name(sym, self.old_key))
        return metrics, tuple(dict.fromkeys(collect))


class _Rename(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(id=self.names.get(node.id, node.id), ctx=node.ctx)


def _unalias(sym: Sym) -> Sym:
    while "alias_of" in sym.info:
        sym = sym.info["alias_of"]
    return sym


def _runtime_name(sym: Sym, old_key: str) -> str:
    sym = _unalias(sym)
    if "expr" in sym.info or sym.kind == "tensor":
        return sym.name
    if sym.kind == "actor_logprob":
        return old_key
    fields = KINDS[sym.kind].fields
    if not fields:
        raise CompileError(
            sym.line, f"{sym.name} ({sym.kind}) is not a tensor the dataflow carries"
        )
    return fields[0]

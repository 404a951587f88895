"""Coordinator-side RL math: the `advantages` driver op (per micro-batch, or per step).

    driver.advantages(rewards [B], response_mask [B, R], + what the estimator needs)
        -> advantages [B, R]          (and returns [B, R] where the estimator defines them)
           sample_mask [B]            (with dynamic_sampling: 1 = row kept for the loss)

Params (the op's `params:` block, checked when the run is planned): the fields of
`AdvantageParams` below, each with its default and its comment (the topology reference
renders them); the estimator's own options and their defaults are
hybridflow.algos.EstimatorOptions', which AdvantageParams extends: the one table of
them, for YAML topologies and compiled step logic alike.

Dynamic sampling, what is and is not done: DAPO drops zero-variance groups and then
samples MORE prompts until the step holds its train batch of informative samples. Here the
filter runs per call inside this op (which cannot ask the data source for more
prompts: the coordinator sizes steps up front), so a step trains on the informative
groups it happened to draw: fewer samples when many groups agree, never a second round
of generation. Over-generating (run.step_batch larger than the train batch) with
`scope: step` and `dynamic_sampling_keep: <train batch>` is verl's recipe with one
generation round: the first informative groups fill the train batch, the surplus is
masked out, and dynamic_sampling/short_count says by how many samples a step fell short.
Counted per step: dynamic_sampling/kept_groups_count, dynamic_sampling/dropped_groups_count
(summed over micro-batches) and dynamic_sampling/kept_frac (share of samples kept).

Per micro-batch or per step (the op's `scope`). With `scope: micro_batch` (the default)
each call sees one micro-batch and its result feeds that micro-batch's actor.update at
once (streamed training): batch statistics (GAE's whitening, REINFORCE++'s normalisation,
dynamic sampling's groups) are the micro-batch's. With `scope: step` the op runs once,
behind a barrier, over the whole step (the scheduler concatenates the micro-batches,
padding responses to the widest, and cuts each output back to every micro-batch's own
width): statistics are the step's, as in verl, which whitens over its training batch;
the cost is the overlap between scoring later micro-batches and training earlier ones,
since no actor.update of the step starts before every micro-batch is scored.

Inputs by estimator (its EstimatorSpec): `needs_groups` ones read `group_index` [B];
`needs_values` ones (gae) read `values` [B, R]; `returns` ones may output `returns`;
kl_penalty reads `ref_logprobs` [B, R] and `<old_logprob_key>` [B, R].

Group estimators need every sample of a prompt in the same call: with the `prompts` data
source and `scope: micro_batch` that is `run.micro_batch % data.options.samples_per_prompt
== 0`, checked at plan time (ConfigError naming run.micro_batch and the sizes that work).

Metrics per call (the coordinator averages micro-batches, which are equal-sized, so
means stay exact): reward/mean, reward/max, reward/min, response_length/mean,
prompt_length/mean (when prompt_mask is an input), adv/mean, adv/abs_mean, plus
reward/sq_mean (turned into reward/std per step by metrics.derive_step_metrics) and,
with a KL penalty, reward/kl (mean per-token KL), reward/kl_penalty (coef * kl) and
actor/kl_coef.

Adaptive coefficient, deterministically: coef(step s) is the controller's value after
the updates of steps 0 .. s-1-k (k = run.max_offpolicy_steps). Those steps have fully
finished before step s may start (the scheduler's start rule), so the value never
depends on timing. A step's update uses the mean KL over all its samples. The
controller lives in the coordinator; checkpoints carry its schedule (`state_dict`), so a
run resumed at step r continues with the coefficient an unbroken run would have used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageResult,
    EstimatorOptions,
    compute_advantages,
)
from hybridflow.algos.kl import (
    KL_ALIASES,
    KL_KINDS,
    apply_kl_penalty,
    kl_estimate,
    make_kl_controller,
)
from hybridflow.algos.shaping import informative_groups, overlong_penalty
from hybridflow.config.loader import from_dict
from hybridflow.config.schema import Topology
from hybridflow.errors import ConfigError, PipelineError
from hybridflow.stages.base import backend_class

Batch = dict[str, torch.Tensor]
GROUP_SOURCE = "prompts"  # the data source that lays steps out in groups (sources/rl.py)


@dataclass
class AdvantageParams(EstimatorOptions):
    """The `advantages` op's params: the estimator's options (EstimatorOptions: gamma,
    lam, whiten, norm_std, eps) and the op's own."""

    estimator: str = "grpo"  # a key of hybridflow.algos.ADVANTAGE_ESTIMATORS
    # null or a KL estimator (k1, k2, k3, ...): subtract kl_coef * KL(policy || reference)
    # from the token rewards before the estimator (PPO's "KL in the reward")
    kl_penalty: str | None = None
    kl_coef: float = 0.0  # the KL penalty's (initial) coefficient
    # null: a fixed kl_coef; a number: adaptive (Ziegler et al.) toward this mean
    # per-token KL, over kl_horizon samples
    kl_target: float | None = None
    kl_horizon: float = 10000.0  # samples over which the adaptive coefficient moves
    old_logprob_key: str = "rollout_logprobs"  # the input holding the behaviour log-probs
    # DAPO's soft overlong penalty (algos.shaping.overlong_penalty), added to the rewards
    # before the estimator: 0 within overlong_max_len - overlong_buffer_len tokens, a ramp
    # to -overlong_penalty_factor at overlong_max_len; 0 disables it
    overlong_buffer_len: int = 0
    overlong_max_len: int = 0  # the response length limit (the rollout's max_new_tokens)
    overlong_penalty_factor: float = 1.0  # the overlong penalty at overlong_max_len
    # DAPO's filter: the samples of groups whose (task) rewards all agree get advantage 0
    # and sample_mask 0, so actor.update leaves them out of the loss and its denominator
    # (declare `sample_mask` as an output here and an input of actor.update); needs a
    # group estimator
    dynamic_sampling: bool = False
    # With `scope: step`: train on at most this many samples, the informative groups in
    # data order (verl's DAPO recipe; generate more than it, run.step_batch, to leave room
    # for dropped groups); 0 = keep all
    dynamic_sampling_keep: int = 0

    def validate(self, path: str) -> None:
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise ConfigError(
                f"{path}.estimator",
                f"unknown estimator {self.estimator!r}; one of {', '.join(ADVANTAGE_ESTIMATORS)}",
            )
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"{path}.{key}", f"must be in [0, 1], got {getattr(self, key)}")
        kinds = (*KL_KINDS, *KL_ALIASES)
        if self.kl_penalty is not None and self.kl_penalty not in kinds:
            raise ConfigError(
                f"{path}.kl_penalty",
                f"must be null or a KL estimator ({', '.join(kinds)}), got {self.kl_penalty!r}",
            )
        if self.kl_coef < 0:
            raise ConfigError(f"{path}.kl_coef", f"must be >= 0, got {self.kl_coef}")
        if self.kl_target is not None and self.kl_target <= 0:
            raise ConfigError(f"{path}.kl_target", "must be > 0 (or null for a fixed coef)")
        if self.kl_horizon <= 0:
            raise ConfigError(f"{path}.kl_horizon", "must be > 0")
        if self.overlong_buffer_len < 0:
            raise ConfigError(f"{path}.overlong_buffer_len", "must be >= 0 (0: no shaping)")
        if self.overlong_buffer_len > 0 and self.overlong_max_len < self.overlong_buffer_len:
            raise ConfigError(
                f"{path}.overlong_max_len",
                f"must be >= overlong_buffer_len ({self.overlong_buffer_len}): the response "
                f"length limit (the rollout's max_new_tokens), got {self.overlong_max_len}",
            )
        if self.overlong_penalty_factor < 0:
            raise ConfigError(f"{path}.overlong_penalty_factor", "must be >= 0")
        if self.dynamic_sampling_keep < 0:
            raise ConfigError(f"{path}.dynamic_sampling_keep", "must be >= 0 (0: keep all)")
        if self.dynamic_sampling_keep and not self.dynamic_sampling:
            raise ConfigError(
                f"{path}.dynamic_sampling_keep", "caps what dynamic_sampling keeps: set it too"
            )
        if self.dynamic_sampling and not ADVANTAGE_ESTIMATORS[self.estimator].needs_groups:
            groups = [n for n, s in ADVANTAGE_ESTIMATORS.items() if s.needs_groups]
            raise ConfigError(
                f"{path}.dynamic_sampling",
                f"filters groups of samples: needs a group estimator ({', '.join(groups)}), "
                f"not {self.estimator!r}",
            )


class Advantages:
    """The `advantages` driver op; one instance per run (see driver/registry.py)."""

    def __init__(self, topology: Topology, index: int) -> None:
        cfg = topology.dataflow[index]
        path = f"dataflow[{index}]"
        self.p = from_dict(AdvantageParams, dict(cfg.params), f"{path}.params")
        self.spec = ADVANTAGE_ESTIMATORS[self.p.estimator]
        self._check_io(cfg.inputs, cfg.outputs, path)
        per_step = cfg.scope == "step"
        if self.spec.needs_groups:
            _check_groups(topology, self.p.estimator, per_step)
        if self.p.dynamic_sampling:
            _check_sample_mask_consumed(topology, path)
        if self.p.dynamic_sampling_keep and not per_step:
            raise ConfigError(
                f"{path}.params.dynamic_sampling_keep",
                "counts samples of the whole step: give this op `scope: step`",
            )
        self.k = topology.run.max_offpolicy_steps
        # Calls per step: one per micro-batch, or one with the whole step (scope: step).
        self.n_mb = 1 if per_step else topology.run.micro_batches
        # The estimator's own options, read from the params (every option of every
        # estimator is an AdvantageParams field; see test_estimator_table).
        self.options = {key: getattr(self.p, key) for key in self.spec.options}
        self.kl = (
            _KLCoefficient(self.p, self.k, self.n_mb) if self.p.kl_penalty is not None else None
        )

    def state_dict(self) -> dict[str, Any]:
        """The KL schedule so far (checkpointed by the coordinator between steps)."""
        if self.kl is None or self.kl.base is None:
            return {}
        return {"kl_values": list(self.kl.values), "kl_base": self.kl.base}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.kl is None or not state:
            return
        values = [float(v) for v in state["kl_values"]]
        self.kl.values, self.kl.base = values, int(state["kl_base"])
        self.kl.ctl.value = values[-1]

    def _check_io(self, inputs: tuple[str, ...], outputs: tuple[str, ...], path: str) -> None:
        need = ["rewards", "response_mask"]
        if self.spec.needs_groups:
            need.append("group_index")
        if self.spec.needs_values:
            need.append("values")
        if self.p.kl_penalty is not None:
            need += ["ref_logprobs", self.p.old_logprob_key]
        missing = [n for n in need if n not in inputs]
        if missing:
            raise ConfigError(
                f"{path}.inputs",
                f"estimator {self.p.estimator!r}"
                + (f" with kl_penalty {self.p.kl_penalty!r}" if self.p.kl_penalty else "")
                + f" needs inputs {need}; missing {missing}",
            )
        if self.p.dynamic_sampling and "sample_mask" not in outputs:
            raise ConfigError(
                f"{path}.outputs",
                "dynamic_sampling drops rows through `sample_mask` [B]: add it to this op's "
                "outputs and to actor.update's inputs",
            )
        can = {"advantages"} | ({"returns"} if self.spec.returns else set())
        if self.p.dynamic_sampling:
            can.add("sample_mask")
        extra = [n for n in outputs if n not in can]
        if extra:
            raise ConfigError(
                f"{path}.outputs",
                f"estimator {self.p.estimator!r} produces {sorted(can)}; cannot produce {extra}",
            )

    # -- the op ------------------------------------------------------------------------
    def __call__(self, batch: Batch, params: dict[str, Any]) -> tuple[Batch, dict[str, float]]:
        step = int(params["step"])
        mask = batch["response_mask"]  # [B, R]
        scores = batch["rewards"].float()  # [B]
        if scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
            raise PipelineError(
                f"advantages: rewards {tuple(scores.shape)} must be [B] with B = {mask.shape[0]}"
            )
        lengths = mask.sum(-1).float()  # [B]
        metrics = _score_metrics(batch, scores, lengths)
        keep = None  # [B] bool, dynamic sampling's rows (on the task reward, before shaping)
        if self.p.dynamic_sampling:
            keep, picked = self._keep(scores, batch["group_index"])
            metrics |= picked
        if self.p.overlong_buffer_len > 0:
            scores, shaped = self._overlong(scores, lengths)
            metrics |= shaped
        fields: dict[str, Any] = {
            "mask": mask,
            "values": batch.get("values"),
            "group_index": batch.get("group_index"),
        }
        if self.kl is None:
            fields["scores"] = scores
        else:
            fields["token_rewards"], penalised = self._kl_rewards(batch, scores, step)
            metrics |= penalised
        res = compute_advantages(self.p.estimator, **fields, **self.options)
        out, adv_metrics = _outputs(res, mask, keep)
        return out, metrics | adv_metrics

    def _keep(
        self, scores: torch.Tensor, group_index: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Dynamic sampling: the rows of groups whose scores [B] differ (cut to
        `dynamic_sampling_keep` rows when set) -> (keep [B] bool, metrics)."""
        keep = informative_groups(scores, group_index)
        n_groups = int(torch.unique(group_index).numel())
        metrics: dict[str, float] = {}
        if self.p.dynamic_sampling_keep:
            keep, short = _first_rows(keep, group_index, self.p.dynamic_sampling_keep)
            metrics["dynamic_sampling/short_count"] = float(short)
        kept_groups = int(torch.unique(group_index[keep]).numel())
        return keep, metrics | {
            "dynamic_sampling/kept_groups_count": float(kept_groups),
            "dynamic_sampling/dropped_groups_count": float(n_groups - kept_groups),
            "dynamic_sampling/kept_frac": float(keep.float().mean()),
        }

    def _overlong(
        self, scores: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """DAPO's soft overlong punishment on scores [B] by response lengths [B]."""
        pen = overlong_penalty(
            lengths,
            self.p.overlong_max_len,
            self.p.overlong_buffer_len,
            self.p.overlong_penalty_factor,
        )  # [B] <= 0
        scores = scores + pen
        return scores, {
            "reward/overlong_penalty": float(pen.mean()),
            "reward/overlong_frac": float((pen < 0).float().mean()),
            "reward/shaped_mean": float(scores.mean()),
        }

    def _kl_rewards(
        self, batch: Batch, scores: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Per-token rewards [B, R]: scores [B] minus the KL penalty at this step's
        coefficient, whose controller observes the KL measured here."""
        assert self.kl is not None
        mask = batch["response_mask"]
        coef = self.kl.coef(step)
        kl = kl_estimate(
            batch[self.p.old_logprob_key].float(),
            batch["ref_logprobs"].float(),
            self.p.kl_penalty or "k1",
            mask,
        )  # [B, R]
        token_rewards, st = apply_kl_penalty(scores, kl, coef, mask)
        mean_kl = float(st["kl"])
        self.kl.observe(step, mean_kl, scores.shape[0])
        return token_rewards, {
            "reward/kl": mean_kl,
            "reward/kl_penalty": coef * mean_kl,
            "actor/kl_coef": coef,
        }


def _score_metrics(batch: Batch, scores: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
    """The step's reward and length statistics, of scores [B] before any shaping."""
    metrics = {
        "reward/mean": float(scores.mean()),
        "reward/sq_mean": float((scores * scores).mean()),
        "reward/max": float(scores.max()),
        "reward/min": float(scores.min()),
        "response_length/mean": float(lengths.mean()),
    }
    if "prompt_mask" in batch:
        metrics["prompt_length/mean"] = float(batch["prompt_mask"].sum(-1).float().mean())
    return metrics


def _outputs(
    res: AdvantageResult, mask: torch.Tensor, keep: torch.Tensor | None
) -> tuple[Batch, dict[str, float]]:
    """The op's outputs from an estimator's result: advantages [B, R] (zero on rows
    dynamic sampling dropped, with their `sample_mask` [B]), returns [B, R] if any."""
    adv = res.advantages.float()  # [B, R]
    valid = mask.bool()
    out: Batch = {}
    if keep is not None:
        adv = adv * keep.unsqueeze(-1).to(adv.dtype)  # dropped groups: no signal
        valid = valid & keep.unsqueeze(-1)
        out["sample_mask"] = keep.to(torch.float32)  # [B]
    metrics = {
        "adv/mean": float(adv[valid].mean()) if valid.any() else 0.0,
        "adv/abs_mean": float(adv[valid].abs().mean()) if valid.any() else 0.0,
    }
    out["advantages"] = adv
    if res.returns is not None:
        out["returns"] = res.returns.float()  # [B, R]
    return out, metrics


def _first_rows(
    keep: torch.Tensor, group_index: torch.Tensor, limit: int
) -> tuple[torch.Tensor, int]:
    """`keep` [B] bool cut to the whole groups that fit in `limit` rows, in data order
    (a group is never split: its samples are compared with each other). -> (mask, how
    many rows short of `limit` the kept groups are)."""
    out = torch.zeros_like(keep)
    taken = 0
    for g in dict.fromkeys(group_index[keep].tolist()):  # informative groups, first seen first
        rows = (group_index == g) & keep
        n = int(rows.sum())
        if taken + n > limit:
            break
        out |= rows
        taken += n
    return out, limit - taken


class _KLCoefficient:
    """Fixed or adaptive KL coefficient with the deterministic schedule of the module
    docstring: values[j] = coefficient after the updates of steps 0 .. j-1."""

    def __init__(self, p: AdvantageParams, k: int, n_mb: int) -> None:
        kind = "fixed" if p.kl_target is None else "adaptive"
        self.ctl = make_kl_controller(kind, p.kl_coef, target_kl=p.kl_target, horizon=p.kl_horizon)
        self.k, self.n_mb = k, n_mb
        self.values = [self.ctl.value]  # values[j]: after steps base .. base+j-1
        self.base: int | None = None  # the first step of this run (> 0 when resumed)
        self._seen: dict[int, list[float]] = {}  # step -> [kl * rows, rows, micro-batches]

    def coef(self, step: int) -> float:
        if self.base is None:
            self.base = step
        j = max(self.base, step - self.k) - self.base
        if j >= len(self.values):
            raise PipelineError(
                f"advantages: KL coefficient for step {step} needs steps < {self.base + j} "
                f"finished; only steps < {self.base + len(self.values) - 1} are"
            )
        return self.values[j]

    def observe(self, step: int, mean_kl: float, rows: int) -> None:
        acc = self._seen.setdefault(step, [0.0, 0.0, 0.0])
        acc[0] += mean_kl * rows
        acc[1] += rows
        acc[2] += 1
        assert self.base is not None  # coef() ran first
        while (s := self.base + len(self.values) - 1) in self._seen and (
            self._seen[s][2] == self.n_mb
        ):
            total, n, _ = self._seen.pop(s)
            self.ctl.update(total / n, int(n))
            self.values.append(self.ctl.value)


def _check_sample_mask_consumed(topo: Topology, path: str) -> None:
    """Dynamic sampling only works if the policy's update reads `sample_mask`."""
    where = topo.role_stage()
    updates = [
        op
        for op in topo.dataflow
        if op.op == "update" and op.role in where and _policy(topo, where[op.role], op.role)
    ]
    if updates and not all("sample_mask" in op.inputs for op in updates):
        raise ConfigError(
            f"{path}.params.dynamic_sampling",
            "actor.update must read `sample_mask` (add it to its inputs), or the dropped "
            "groups still count in the loss's denominator",
        )


def _policy(topo: Topology, stage: str, role: str) -> bool:
    """Whether `role`'s backend class trains the run's policy (stages/contract.py)."""
    rc = topo.stages[stage].roles[role]
    return bool(backend_class(rc.kind_of(role), rc.backend).exports_policy)


def _check_groups(topo: Topology, estimator: str, per_step: bool) -> None:
    """Group estimators: all n samples of a prompt in one call (micro-batch, or the step
    with scope: step), n >= 2."""
    if topo.data.source != GROUP_SOURCE:
        return  # another source provides group_index; the estimator checks groups at run time
    n = topo.data.options.get("samples_per_prompt", 1)
    if not isinstance(n, int) or n < 2:
        raise ConfigError(
            "data.options.samples_per_prompt",
            f"estimator {estimator!r} compares the samples of a prompt: needs >= 2, got {n!r}",
        )
    mb = topo.run.micro_batch
    if mb % n and not per_step:
        ok = [m for m in range(n, topo.run.step_batch + 1, n) if topo.run.step_batch % m == 0]
        raise ConfigError(
            "run.micro_batch",
            f"{mb} is not a multiple of data.options.samples_per_prompt ({n}): estimator "
            f"{estimator!r} needs all {n} samples of a prompt in one micro-batch; use one of "
            f"{', '.join(map(str, ok[:8])) or f'a multiple of {n} dividing run.step_batch'}",
        )

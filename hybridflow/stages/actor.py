"""The actor role (backend `hf`): the policy's training weights, its log-probs, its update,
and the hand-off of its weights to the rollout engine (reshard).

Ops (every batch uses the sequence layout of stages/common.py: prompt_ids/prompt_mask
[B, P], response_ids/response_mask [B, R]):

  get_logprob     -> old_logprobs [B, R] float32   log pi(token) under the current policy,
                                                   logits / `temperature` (0 at padding)
                     entropy      [B, R] float32   policy entropy per response position
  update          + advantages    [B, R]           required
                  + old_logprobs  [B, R]           optional (`old_logprob_key`); when
                                                   absent, computed now (= the policy
                                                   before this step's first update)
                  + ref_logprobs  [B, R]           required iff kl_loss_coef > 0; else
                                                   only reported as actor/kl
                  + <rollout_logprob_key> [B, R]   required iff rollout_correction is set
                  + sample_mask   [B]              optional: rows with 0 are left out of
                                                   the loss and its denominator (the
                                                   advantages op's dynamic sampling)
                  -> {}  metrics: this micro-batch's actor/pg_loss, ... (streamed mode)
  sft_update      supervised NLL of the response tokens (SFT-then-RL); -> {}
  optimizer_step  (no batch) -> {}  metrics actor/pg_loss, actor/pg_clipfrac,
                  actor/pg_clipfrac_lower, actor/ppo_kl, actor/entropy, actor/kl,
                  actor/sft_loss (whichever ran), actor/grad_norm, actor/lr,
                  actor/updates, actor/skipped_updates, actor/policy_version.
                  These step-level numbers are the authoritative ones.
  reshard         (colocated) push the weights into ctx.colocated[rollout_role] through
                  its `update_weights((name, tensor) iterator, version)`, tensor by tensor,
                  in place on the device (no host copy); -> {} + the rollout's metrics.
                  (Rollout in another stage: the runtime answers this op itself and
                  streams `weight_buckets()` to it; see pipeline/host/weight_sync.py.)
  export_weights  (disaggregated) params {bucket: int = -1} -> that bucket's
                  {parameter name: tensor} on CPU (-1: all); metrics weights/num_buckets,
                  weights/bytes. Buckets hold whole parameters, <= weight_bucket_mb each.

Micro-batches, ppo_epochs, mini_batches: trainer.py; token budgets, packing: packing.py.
The loss: `policy_loss` (ppo: clip with clip_ratio_low/high, dual_clip_c | gspo:
sequence ratio and clip | cispo: clipped IS weight x log-prob) - entropy_coef * entropy
+ kl_loss_coef * KL(kl_loss_type), all aggregated by `loss_agg_mode` (Dr. GRPO's
seq-mean-token-sum-norm divides by the constant `loss_norm_len`; hybridflow.algos).
Rollout correction (`rollout_correction: tis | mis`): the policy loss is weighted by
pi_old / mu between `old_logprob_key` (the actor's) and `rollout_logprob_key` (the
sampler's) log-probs; MIS drops whole sequences from the loss and its denominator.
Metrics actor/rollout_corr/{mismatch_kl, mismatch_k3, weight_mean, weight_max,
masked_frac} (weight_max: the mean of micro-batch maxima).

LoRA (`lora_rank > 0`, models/lora.py): only adapters train; a sync sends the merged
weights under the base names, or with `lora_sync: adapters` the whole model once and then
the adapters only (stages/actor_sync.py); a colocated reference runs on the base weights.

Several devices (stages/parallel/): the actor's replicas are the ranks of one FSDP
group (`fsdp*` options); every task reaches every rank with its share of the rows,
weights leave gathered one parameter at a time (`named_weights`, collective).

Invariants: the policy version is the number of optimizer steps taken; weights leave
detached; `state_dict` holds the scheduler, shuffle generator and the version, and the
checkpoint store writes weights and optimizer moments through `save_shards` (DCP, any
rank count).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.algos.correction import CorrectionMode, rollout_correction
from hybridflow.algos.kl import KL_ALIASES, KL_KINDS, kl_estimate, kl_loss
from hybridflow.algos.losses import (
    LossAggMode,
    PolicyLossName,
    aggregate,
    entropy_bonus,
    policy_loss,
)
from hybridflow.config.loader import from_dict
from hybridflow.errors import BatchError, ConfigError
from hybridflow.models.head_logprobs import LogprobOptions
from hybridflow.models.loader import ModelOptions
from hybridflow.models.lora import LoraOptions, LoraSync
from hybridflow.stages.actor_sync import PolicySender
from hybridflow.stages.base import Batch, Metrics, Params, StageContext
from hybridflow.stages.common import (
    SEQUENCE_FIELDS,
    build_model,
    check_sequences,
    chunked_no_grad,
    options_path,
    response_logprobs,
    training_attention,
)
from hybridflow.stages.contract import RoleBase, Scope, op
from hybridflow.stages.packing import (
    PackingOptions,
    Rows,
    check_packing,
    compile_layers,
    forward_groups,
    gather_rows,
    group_batch,
)
from hybridflow.stages.parallel.options import ShardingOptions
from hybridflow.stages.parallel.role import ShardedModelRole
from hybridflow.stages.trainer import Trainer, TrainOptions, denominator


@dataclass
class ActorOptions(
    ModelOptions, TrainOptions, ShardingOptions, LoraOptions, LogprobOptions, PackingOptions
):
    temperature: float = 1.0  # logits / temperature before log-probs: match the rollout's
    clip_ratio_low: float = 0.2  # PPO clip: ratios below 1 - this are clipped
    clip_ratio_high: float | None = None  # None: = clip_ratio_low
    dual_clip_c: float | None = None  # > 1 enables dual-clip
    entropy_coef: float = 0.0  # > 0: an entropy bonus, - coef * entropy in the loss
    kl_loss_coef: float = 0.0  # > 0: KL to the reference as a loss term (GRPO)
    kl_loss_type: str = "k3"  # k1 | k2 | k3 | abs | k1+ | k3+ (or kl | mse | low_var_kl)
    old_logprob_key: str = "old_logprobs"  # e.g. rollout_logprobs to use the sampler's
    policy_loss: PolicyLossName = "ppo"  # the objective (hybridflow.algos)
    # TrainOptions' modes plus seq-mean-token-sum-norm (Dr. GRPO: / loss_norm_len)
    loss_agg_mode: LossAggMode = "token-mean"
    loss_norm_len: int = 0  # seq-mean-token-sum-norm's constant (e.g. max_new_tokens)
    rollout_correction: CorrectionMode | None = None  # weights pi_old / mu
    rollout_logprob_key: str = "rollout_logprobs"  # the sampler's log-probs (mu)
    rollout_is_cap: float = 2.0  # TIS: token weights truncated at this C
    rollout_mis_low: float = 0.5  # MIS: keep sequences whose ratio is in [low, high]
    rollout_mis_high: float = 2.0  # MIS: the upper end of that range
    rollout_role: str = "rollout"  # colocated role that `reshard` writes into
    # LoRA: what a sync sends the rollout. merged: the full merged weights every time (any
    # backend; decode runs the plain model). adapters: the whole model once, then only the
    # adapters (MBs), the rollout holding them unmerged (hf, native; stages/actor_sync.py)
    lora_sync: LoraSync = "merged"
    weight_bucket_mb: float = 64.0  # reshard/export buckets hold whole parameters up to this
    gradient_checkpointing: bool = False  # recompute activations in backward (transformers')

    def validate(self, path: str) -> None:
        ModelOptions.validate(self, path)
        TrainOptions.validate(self, path)
        self.validate_sharding(path)
        self.validate_lora(path)
        self.validate_logprob(path)
        self.validate_packing(path)
        if self.temperature <= 0:
            raise ConfigError(f"{path}.temperature", f"must be > 0, got {self.temperature}")
        if self.kl_loss_type not in (*KL_KINDS, *KL_ALIASES):
            raise ConfigError(
                f"{path}.kl_loss_type",
                f"must be one of {', '.join(KL_KINDS)} (or {', '.join(KL_ALIASES)}), "
                f"got {self.kl_loss_type!r}",
            )
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.loss_norm_len <= 0:
            raise ConfigError(
                f"{path}.loss_norm_len",
                "loss_agg_mode seq-mean-token-sum-norm divides by a fixed length: set "
                "loss_norm_len > 0 (Dr. GRPO uses the generation budget, max_new_tokens)",
            )
        if self.dual_clip_c is not None and self.policy_loss != "ppo":
            raise ConfigError(f"{path}.dual_clip_c", f"is PPO's; unset it for {self.policy_loss}")
        if self.rollout_correction is not None:
            if self.rollout_logprob_key == self.old_logprob_key:
                raise ConfigError(
                    f"{path}.rollout_logprob_key",
                    f"rollout_correction weighs {self.old_logprob_key} (the actor's) against "
                    "the sampler's log-probs: they must be different inputs (set "
                    "old_logprob_key: old_logprobs and add an actor.get_logprob op)",
                )
            if self.rollout_is_cap <= 0:
                raise ConfigError(f"{path}.rollout_is_cap", "must be > 0")
            if not 0.0 <= self.rollout_mis_low <= 1.0 <= self.rollout_mis_high:
                raise ConfigError(
                    f"{path}.rollout_mis_low",
                    "need 0 <= rollout_mis_low <= 1 <= rollout_mis_high",
                )
        if self.weight_bucket_mb <= 0:
            raise ConfigError(f"{path}.weight_bucket_mb", "must be > 0")
        if self.lora_sync == "adapters" and not self.lora:
            raise ConfigError(
                f"{path}.lora_sync", "adapters syncs LoRA adapters: set lora_rank > 0 (or unset it)"
            )


class Actor(PolicySender, ShardedModelRole, RoleBase):
    """Registered as ("actor", "hf")."""

    options_cls = ActorOptions  # checked at plan time too (pipeline/plan/planner.py)
    trainable = True
    sends_weights = True
    exports_policy = True

    def __init__(self) -> None:
        self.opts: ActorOptions | None = None
        self.model: Any = None
        self.trainer: Trainer | None = None
        self.version = 0
        self._channels: set[str] = set()  # sync channels served the base (actor_sync.py)

    # -- lifecycle -----------------------------------------------------------------------
    def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.opts = from_dict(ActorOptions, dict(ctx.options), options_path(ctx))
        self.device = ctx.device
        self.tokenizer, self.model = build_model(ctx, self.opts, "causal_lm")
        training_attention(ctx.device)  # before any forward: see its docstring
        self.add_adapters(ctx, self.opts, "causal_lm")
        if self.opts.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
            self.model.train()  # HF only checkpoints in train mode; dropout is 0 anyway
            if self.adapters is not None:
                # Reentrant checkpointing (transformers 4's default; 5 checkpoints without
                # reentry) gives the adapters no grad unless a block's input needs one, and
                # the frozen embeddings' output does not.
                self.model.enable_input_require_grads()
        self.shard_if_asked(ctx, self.opts, trainable=True)
        check_packing(self.opts, self.model, self.group is not None, options_path(ctx))
        compile_layers(
            self.opts.compile_layers,
            self.model,
            self.group is not None,
            options_path(ctx),
            lambda b: self._logprobs(b)[0],
            (True, False),  # update (grad) and the log-prob ops (no grad)
            self.opts.max_tokens_per_micro_batch,
        )
        self.trainer = Trainer(
            self.model,
            self.opts,
            # Ranks of one model shuffle mini-batches alike; lone replicas need no offset.
            seed=ctx.seed,
            prefix="actor",
            log=ctx.log,
            group=self.group,
            split=self._groups,
        )

    def close(self) -> None:
        self.model = self.trainer = None

    def state_dict(self) -> dict[str, Any]:
        """Weights and optimizer moments are not here: `save_shards` writes them."""
        assert self.trainer is not None
        return {"trainer": self.trainer.state_dict(optimizer=False), "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.trainer is not None
        self.trainer.load_state_dict(state["trainer"])
        self.version = int(state["version"])

    # -- ops -----------------------------------------------------------------------------
    @op(name="get_logprob", inputs=SEQUENCE_FIELDS, outputs=("old_logprobs", "entropy"))
    def _op_get_logprob(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """Log-probs and entropy of the responses under the current weights."""
        return self.get_logprob(batch), {}

    @op(name="update", inputs=(*SEQUENCE_FIELDS, "advantages"))
    def _op_update(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """Accumulate the PPO/GRPO policy gradient of one micro-batch."""
        return {}, self.update(batch)

    @op(name="sft_update", inputs=SEQUENCE_FIELDS)
    def _op_sft_update(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """Accumulate the SFT (cross-entropy) gradient of one micro-batch."""
        return {}, self.sft_update(batch)

    @op(name="optimizer_step", scope=Scope.STEP)
    def _op_optimizer_step(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """Apply the accumulated gradients (one optimizer step)."""
        return {}, self.optimizer_step()

    @op(name="reshard", scope=Scope.STEP)
    def _op_reshard(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """Hand the weights to the colocated rollout engine."""
        return {}, self.reshard(params.get("version"))

    @op(name="export_weights", scope=None, outputs=None)
    def _op_export_weights(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """The weights as tensors (one bucket, or all with bucket -1)."""
        return self.export_weights(int(params.get("bucket", -1)))

    def get_logprob(self, batch: Batch) -> Batch:
        check_sequences(batch, "actor.get_logprob", self.model.config.vocab_size)
        lps, ents = [], []
        with torch.no_grad():
            for rows in self._groups(batch):
                lp, ent = self._logprobs(group_batch(batch, rows), with_entropy=True)
                assert ent is not None
                lps.append((rows, lp.float().cpu()))
                ents.append((rows, ent.float().cpu()))
        n, r = batch["response_ids"].shape
        return {"old_logprobs": gather_rows(lps, n, r), "entropy": gather_rows(ents, n, r)}

    def _groups(self, batch: Batch) -> Iterator[Rows]:
        """The row groups of one forward each (forward_batch_size rows or a token budget)."""
        assert self.opts is not None
        return forward_groups(batch, self.opts, self.opts.forward_batch_size)

    def _logprobs(
        self, mb: Batch, *, with_entropy: bool = False, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [b, R] (and entropy) of one forward, padded or packed per the options."""
        o = self.opts
        assert o is not None
        return response_logprobs(
            self.model,
            mb,
            self.device,
            o.temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            chunk_tokens=o.logprob_chunk_tokens,
            packed=o.pack_sequences,
            kernel=o.logprob_kernel,
        )

    def _logprobs_no_grad(self, batch: Batch) -> torch.Tensor:
        return chunked_no_grad(lambda b: self._logprobs(b)[0], batch, 0, groups=self._groups(batch))

    def update(self, batch: Batch) -> Metrics:
        o, t = self.opts, self.trainer
        assert o is not None and t is not None
        where = "actor.update"
        check_sequences(batch, where, self.model.config.vocab_size)
        mb = {k: batch[k] for k in SEQUENCE_FIELDS}
        mask = batch["response_mask"]
        mb["advantages"] = _field(batch, "advantages", mask, where)
        if o.old_logprob_key in batch:
            mb["old_logprobs"] = _field(batch, o.old_logprob_key, mask, where)
        else:
            # On-policy: the policy before this step's first update is the behaviour policy.
            mb["old_logprobs"] = self._logprobs_no_grad(mb)
        if "ref_logprobs" in batch:
            mb["ref_logprobs"] = _field(batch, "ref_logprobs", mask, where)
        elif o.kl_loss_coef > 0:
            raise BatchError(f"{where}: kl_loss_coef > 0 needs `ref_logprobs` in the batch")
        if o.rollout_correction is not None:
            mb["rollout_logprobs"] = _field(batch, o.rollout_logprob_key, mask, where)
        if "sample_mask" in batch:  # [B] rows the advantages op kept (dynamic sampling)
            keep = batch["sample_mask"]
            if keep.shape != mask.shape[:1]:
                raise BatchError(f"{where}: sample_mask is {tuple(keep.shape)}, expected [B]")
            # The loss mask only: the forward pass still sees the whole sequence.
            mb["loss_mask"] = mask * (keep != 0).to(mask.dtype).unsqueeze(-1)
        return t.add(mb, self._ppo_loss)

    def sft_update(self, batch: Batch) -> Metrics:
        assert self.trainer is not None
        check_sequences(batch, "actor.sft_update", self.model.config.vocab_size)
        return self.trainer.add(dict(batch), self._sft_loss)

    def optimizer_step(self) -> Metrics:
        assert self.trainer is not None
        metrics = self.trainer.step()
        self.version += 1
        metrics["actor/policy_version"] = float(self.version)
        return metrics

    # -- losses (sum form; see trainer.py) -----------------------------------------------
    def _ppo_loss(self, mb: Batch) -> tuple[torch.Tensor, int, dict[str, float]]:
        o = self.opts
        assert o is not None
        dev, agg = self.device, o.loss_agg_mode
        norm_len = float(o.loss_norm_len) if o.loss_norm_len > 0 else None
        mask = mb.get("loss_mask", mb["response_mask"]).to(dev)
        old_logprobs = mb["old_logprobs"].to(dev, torch.float32)
        weights, mask, stats = self._correction(mb, old_logprobs, mask)
        count = denominator(mask, agg)
        if count == 0 and self.group is None:
            # Every row dropped (dynamic sampling / MIS): nothing to learn here. A rank of
            # a sharded model still runs forward and backward (a zero loss): its peers'
            # collectives wait for it.
            return torch.zeros((), device=dev, requires_grad=True), 0, stats
        logprobs, entropy = self._logprobs(mb, with_entropy=True, entropy_grad=o.entropy_coef != 0)
        assert entropy is not None
        loss, st = policy_loss(
            o.policy_loss,
            logprobs,
            old_logprobs,
            mb["advantages"].to(dev, torch.float32),
            mask,
            o.clip_ratio_low,
            o.clip_ratio_high,
            agg,
            dual_clip_c=o.dual_clip_c,
            denom=1.0,
            norm_len=norm_len,
            weights=weights,
        )
        stats |= {
            "pg_loss": float(st["pg_loss"]) / max(count, 1),
            "pg_clipfrac": float(st["pg_clipfrac"]),
            "pg_clipfrac_lower": float(st["pg_clipfrac_lower"]),
            "ppo_kl": float(st["ppo_kl"]),
            "entropy": float(aggregate(entropy.detach(), mask, agg, norm_len=norm_len)),
        }
        if o.entropy_coef != 0:
            bonus, _ = entropy_bonus(
                entropy, mask, o.entropy_coef, agg, denom=1.0, norm_len=norm_len
            )
            loss = loss + bonus
        if "ref_logprobs" in mb:
            loss = loss + self._kl_term(logprobs, mb["ref_logprobs"], mask, count, stats)
        return loss, count, stats

    def _correction(
        self, mb: Batch, old_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
        """Rollout correction (TIS/MIS) -> (token weights | None, the loss mask, stats)."""
        o = self.opts
        assert o is not None
        if o.rollout_correction is None:
            return None, mask, {}
        corr = rollout_correction(
            old_logprobs,
            mb["rollout_logprobs"].to(self.device, torch.float32),
            mask,
            o.rollout_correction,
            cap=o.rollout_is_cap,
            low=o.rollout_mis_low,
            high=o.rollout_mis_high,
        )
        stats = {f"rollout_corr/{k}": float(v) for k, v in corr.stats.items()}
        return corr.weights, corr.mask.to(mask.dtype), stats

    def _kl_term(
        self,
        logprobs: torch.Tensor,
        ref: torch.Tensor,
        mask: torch.Tensor,
        count: int,
        stats: Metrics,
    ) -> torch.Tensor | float:
        """The KL-to-reference loss term (sum form; 0 when kl_loss_coef is 0, the KL then
        only reported); sets stats["kl"]."""
        o = self.opts
        assert o is not None
        agg = o.loss_agg_mode
        norm_len = float(o.loss_norm_len) if o.loss_norm_len > 0 else None
        ref = ref.to(self.device, torch.float32)
        if o.kl_loss_coef > 0:
            coef, kind = o.kl_loss_coef, o.kl_loss_type
            term, kst = kl_loss(logprobs, ref, mask, coef, kind, agg, denom=1.0, norm_len=norm_len)
            stats["kl"] = float(kst["kl_loss"]) / max(count, 1)
            return term
        with torch.no_grad():
            kl = kl_estimate(logprobs.detach(), ref, o.kl_loss_type, mask)
            stats["kl"] = float(aggregate(kl, mask, agg, norm_len=norm_len))
        return 0.0

    def _sft_loss(self, mb: Batch) -> tuple[torch.Tensor, int, dict[str, float]]:
        assert self.opts is not None
        agg = self.opts.loss_agg_mode
        mask = mb["response_mask"].to(self.device)
        o = self.opts
        logprobs, _ = response_logprobs(
            self.model,
            mb,
            self.device,
            chunk_tokens=o.logprob_chunk_tokens,
            packed=o.pack_sequences,
            kernel=o.logprob_kernel,
        )
        count = denominator(mask, agg)
        loss = aggregate(-logprobs, mask, agg, denom=1.0)
        return loss, count, {"sft_loss": float(loss.detach()) / max(count, 1)}


def _field(batch: Batch, name: str, mask: torch.Tensor, where: str) -> torch.Tensor:
    """A per-token float field [B, R], checked against `mask` [B, R]: finite where valid."""
    if name not in batch:
        raise BatchError(f"{where}: batch lacks {name!r}; it has {sorted(batch)}")
    t = batch[name]
    if t.shape != mask.shape:
        raise BatchError(
            f"{where}: {name} is {tuple(t.shape)}, expected {tuple(mask.shape)} (= response_ids)"
        )
    if not t.dtype.is_floating_point:
        raise BatchError(f"{where}: {name} must be floating point, got {t.dtype}")
    if not bool(torch.isfinite(t[mask.bool()]).all()):
        raise BatchError(f"{where}: {name} holds NaN/inf at response tokens")
    return t

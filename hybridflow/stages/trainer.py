"""Gradient accumulation, PPO epochs / mini-batches, AdamW and the LR schedule, shared by
the actor and the critic.

How a training step maps onto events (the contract with the coordinator):

    update(mb 0) ... update(mb M-1)     one call per micro-batch of the step, any order
    optimizer_step()                    once, behind the step barrier

  - `mini_batches == 1` (default): each `update` runs forward+backward at once (training
    streams while later micro-batches are still being scored) and gradients accumulate;
    `optimizer_step` applies them. With `ppo_epochs = E > 1` the role also keeps the
    micro-batches and, inside `optimizer_step`, replays them E - 1 more times, one
    optimizer update per epoch.
  - `mini_batches = K > 1`: `update` only keeps the micro-batch; `optimizer_step` runs
    E epochs, each a seeded shuffle of the kept micro-batches split into K mini-batches
    (whole micro-batches; needs M >= K), one optimizer update per mini-batch.
  The coordinator never re-sends anything. The LR schedule advances once per
  `optimizer_step` (warm-up and decay are counted in RL steps).

Loss normalisation: a loss function returns its *sum form* (the algos' `aggregate` with
`denom=1`) and its own denominator (valid tokens for token-mean, non-empty rows for the
sequence modes). Gradients are divided by the total denominator of the mini-batch just
before clipping, so the update equals one big-batch update whatever the micro-batch
split (tested) and no role needs to know M in advance. The same holds inside a
micro-batch: its forwards (`split`: `forward_batch_size` rows, or the token-budget groups
of stages/packing.py) are row groups, every aggregation mode's sum form is a sum over
rows of a quantity of that row alone, and the denominators add up; so what is held equal
across any split is (sum of the groups' sum-form losses) / (sum of their denominators),
per token exactly the big-batch value (tested for token-budget groups,
tests/stages/test_stages_packing.py).

Sharded (FSDP, stages/parallel/): each rank accumulates its share of every micro-batch;
the denominator and the reported sums are summed over the ranks before use, and FSDP's
reduce-scatter averages gradients over the ranks, so the update equals one process's on
the whole micro-batches (tested against one process with gloo). The mini-batch shuffle
seed must then be the same on every rank (the roles pass the run seed).

Invariants: `optimizer_step` without a preceding `update` is an error (never a silent
no-op); a non-finite gradient norm skips the update (logged, counted in
`<prefix>/skipped_updates`); checkpoints are only taken between steps.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hybridflow.algos.losses import TrainerAggMode
from hybridflow.errors import BatchError, ConfigError
from hybridflow.stages.base import Batch, Metrics
from hybridflow.stages.common import row_chunks, to_cpu
from hybridflow.stages.packing import Rows, group_batch
from hybridflow.stages.parallel.fsdp import norm_value
from hybridflow.stages.parallel.group import Group

# (micro-batch rows) -> (loss in sum form with grad, denominator, per-row-mean stats)
LossFn = Callable[[Batch], tuple[torch.Tensor, int, dict[str, float]]]
# (micro-batch) -> the row groups that run one forward+backward each, covering every row
Split = Callable[[Batch], Iterable[Rows]]


@dataclass
class TrainOptions:
    """Optimizer, schedule and update-structure options (actor and critic)."""

    lr: float = 1e-5  # AdamW learning rate (the peak, with a schedule)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's moment decay rates
    eps: float = 1e-8  # AdamW's denominator epsilon
    warmup_steps: int = 0  # linear warm-up over this many optimizer_step calls
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"  # after the warm-up
    total_steps: int = 0  # steps of the decay (cosine/linear); required by them
    min_lr_ratio: float = 0.0  # floor of the decay, as a share of lr
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping
    ppo_epochs: int = 1  # passes over the step's micro-batches, one optimizer update each
    mini_batches: int = 1  # optimizer updates per epoch
    # How per-token losses reduce to one: token-mean (over every valid token),
    # seq-mean-token-sum / seq-mean-token-mean (per sequence, then over sequences)
    loss_agg_mode: TrainerAggMode = "token-mean"
    forward_batch_size: int = 0  # rows per forward/backward (0: the whole micro-batch)

    def validate(self, path: str) -> None:
        def bad(key: str, msg: str) -> ConfigError:
            return ConfigError(f"{path}.{key}" if path else key, msg)

        if self.lr <= 0:
            raise bad("lr", f"must be > 0, got {self.lr}")
        if self.ppo_epochs < 1:
            raise bad("ppo_epochs", f"must be >= 1, got {self.ppo_epochs}")
        if self.mini_batches < 1:
            raise bad("mini_batches", f"must be >= 1, got {self.mini_batches}")
        if self.warmup_steps < 0:
            raise bad("warmup_steps", "must be >= 0")
        if self.lr_schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise bad(
                "total_steps",
                f"lr_schedule {self.lr_schedule!r} needs total_steps > warmup_steps "
                f"({self.warmup_steps}); got {self.total_steps}",
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise bad("min_lr_ratio", "must be in [0, 1]")


def lr_factor(opts: TrainOptions, step: int) -> float:
    """LR multiplier at optimizer_step number `step` (0-based)."""
    if step < opts.warmup_steps:
        return (step + 1) / opts.warmup_steps
    if opts.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - opts.warmup_steps) / (opts.total_steps - opts.warmup_steps))
    if opts.lr_schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        decay = 1.0 - progress
    return opts.min_lr_ratio + (1.0 - opts.min_lr_ratio) * decay


def denominator(mask: torch.Tensor, mode: str) -> int:
    """What `aggregate(mode)` divides by: valid tokens, or rows with a valid token."""
    m = mask != 0
    return int(m.sum()) if mode == "token-mean" else int(m.any(dim=-1).sum())


class Trainer:
    """Accumulates micro-batch gradients and applies them (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        opts: TrainOptions,
        *,
        seed: int,
        prefix: str,
        log: logging.Logger,
        group: Group | None = None,
        split: Split | None = None,
    ) -> None:
        self.model, self.opts, self.prefix, self.log = model, opts, prefix, log
        self.split = split or (lambda mb: row_chunks(_rows(mb), opts.forward_batch_size))
        self.group = group  # set: the model is sharded over these ranks (FSDP)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=opts.lr,
            betas=opts.betas,
            eps=opts.eps,
            weight_decay=opts.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(opts, s)
        )
        self.generator = torch.Generator().manual_seed(seed)  # mini-batch shuffles
        self._kept: list[tuple[Batch, LossFn]] = []
        self._denom = 0  # of the gradients accumulated since the last update
        self._pending = False  # gradients accumulated, not yet applied
        self._stat_sum: dict[str, float] = {}
        self._stat_weight: dict[str, float] = {}
        self._grad_norms: list[float] = []
        self._skipped = 0

    @property
    def streaming(self) -> bool:
        return self.opts.mini_batches == 1

    # -- events --------------------------------------------------------------------------
    def add(self, mb: Batch, loss_fn: LossFn) -> Metrics:
        """One micro-batch of this step (see the module docstring for when it computes)."""
        if self.streaming:
            stats = self._accumulate(mb, loss_fn)
            if self.opts.ppo_epochs > 1:
                self._kept.append((mb, loss_fn))
            return {f"{self.prefix}/{k}": v for k, v in stats.items()}
        self._kept.append((mb, loss_fn))
        return {}

    def step(self) -> Metrics:
        """Apply this step's updates (epochs x mini-batches), advance the LR schedule."""
        if not self._pending and not self._kept:
            raise BatchError(
                f"{self.prefix}: optimizer_step without any update since the last step"
            )
        lr = self.optimizer.param_groups[0]["lr"]
        epochs = self.opts.ppo_epochs
        if self.streaming:
            self._apply()
            for _ in range(1, epochs):
                for mb, fn in self._kept:
                    self._accumulate(mb, fn)
                self._apply()
        else:
            n, k = len(self._kept), self.opts.mini_batches
            if n < k:
                self._kept.clear()
                raise BatchError(
                    f"{self.prefix}: {n} micro-batch(es) in the step cannot form "
                    f"mini_batches={k}; lower mini_batches or send more micro-batches"
                )
            for _ in range(epochs):
                order = torch.randperm(n, generator=self.generator)
                for chunk in torch.tensor_split(order, k):
                    for i in chunk.tolist():
                        self._accumulate(*self._kept[i])
                    self._apply()
        self._kept.clear()
        with warnings.catch_warnings():
            # A step whose rows were all left out (dynamic sampling, MIS) applies no
            # update, yet the schedule counts RL steps: torch's order warning is moot.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step")
            self.scheduler.step()
        sums, weights = self._global_stats()
        metrics = {f"{self.prefix}/{k}": sums[k] / weights[k] for k in sums if weights[k] > 0}
        norms = [g for g in self._grad_norms if math.isfinite(g)]
        metrics[f"{self.prefix}/grad_norm"] = sum(norms) / len(norms) if norms else math.nan
        metrics[f"{self.prefix}/lr"] = lr
        metrics[f"{self.prefix}/updates"] = float(len(self._grad_norms))
        metrics[f"{self.prefix}/skipped_updates"] = float(self._skipped)
        self._stat_sum, self._stat_weight, self._grad_norms, self._skipped = {}, {}, [], 0
        return metrics

    # -- internals -----------------------------------------------------------------------
    def _global_stats(self) -> tuple[dict[str, float], dict[str, float]]:
        """This step's denominator-weighted stat sums and weights, over all ranks."""
        if self.group is None:
            return self._stat_sum, self._stat_weight
        keys = self.group.union(list(self._stat_sum))
        flat = [self._stat_sum.get(k, 0.0) for k in keys]
        flat += [self._stat_weight.get(k, 0.0) for k in keys]
        total = self.group.sum(flat)
        n = len(keys)
        return dict(zip(keys, total[:n], strict=True)), dict(zip(keys, total[n:], strict=True))

    def _accumulate(self, mb: Batch, loss_fn: LossFn) -> dict[str, float]:
        mb_sum: dict[str, float] = {}
        mb_weight = 0
        for rows in self.split(mb):
            loss, denom, stats = loss_fn(group_batch(mb, rows))
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"{self.prefix}: non-finite loss {float(loss)} on a micro-batch "
                    f"(stats {stats}); check the inputs (advantages, log-probs)"
                )
            loss.backward()
            self._denom += denom
            mb_weight += denom
            for k, v in stats.items():
                mb_sum[k] = mb_sum.get(k, 0.0) + v * denom
                self._stat_sum[k] = self._stat_sum.get(k, 0.0) + v * denom
                self._stat_weight[k] = self._stat_weight.get(k, 0.0) + denom
        self._pending = True
        return {k: v / mb_weight for k, v in mb_sum.items()} if mb_weight else {}

    def _apply(self) -> None:
        """Turn accumulated sum-form gradients into one optimizer update."""
        denom = float(self._denom)
        scale = denom
        if self.group is not None:
            # Every rank takes the same branch below: the denominator and (through the
            # DTensor norm) the grad norm are global.
            denom = self.group.sum([denom])[0]
            scale = denom / self.group.world_size  # FSDP averaged the ranks' gradients
        if denom > 0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(scale)
            max_norm = self.opts.grad_clip if self.opts.grad_clip > 0 else math.inf
            norm = norm_value(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
            self._grad_norms.append(norm)
            if math.isfinite(norm):
                self.optimizer.step()
            else:
                self._skipped += 1
                self.log.warning("%s: grad norm is %s; update skipped", self.prefix, norm)
        self.optimizer.zero_grad(set_to_none=True)
        self._denom, self._pending = 0, False

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self, *, optimizer: bool = True) -> dict[str, Any]:
        """`optimizer=False`: without the optimizer's state (a role that writes it as
        sharded tensors, stages/parallel/checkpoint.py)."""
        if self._pending or self._kept:
            raise BatchError(f"{self.prefix}: state_dict in the middle of a step (updates pending)")
        state: dict[str, Any] = {
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
        }
        if optimizer:
            state["optimizer"] = to_cpu(self.optimizer.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "optimizer" in state:
            self.optimizer.load_state_dict(to_cpu(state["optimizer"]))  # never alias
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])


def _rows(mb: Batch) -> int:
    return next(iter(mb.values())).shape[0]

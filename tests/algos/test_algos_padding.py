"""One property over every masked function: garbage at padding changes no output or stat.

Each case runs once on clean inputs and once with every padding slot of every [B, T]
input overwritten by NaN / +-inf / huge values; outputs, stats and gradients must be
bit-identical. (The per-module tests check the values themselves by hand.)
"""

from __future__ import annotations

import pytest
import torch

from hybridflow import algos

B, T = 6, 5
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
MASK = torch.tensor(
    [
        [1, 1, 1, 1, 1],
        [1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 1, 1, 0],
        [1, 1, 1, 1, 0],
    ]
)
PAD = ~MASK.bool()


def _inputs(garbage: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    names = ("a", "b", "c", "d")
    out = {n: torch.randn(B, T, generator=g) for n in names}
    if garbage:
        fills = (float("nan"), float("inf"), -float("inf"), 1e30)
        out = {n: out[n].masked_fill(PAD, fills[i]) for i, n in enumerate(names)}
    return out


def _flatten(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, dict):
        return [result[k] for k in sorted(result)]
    if result is None:
        return []
    return [t for item in result for t in _flatten(item)]


CASES = {
    "masked_mean_rows": lambda x: algos.masked_mean(x["a"], MASK, dim=-1),
    "masked_var": lambda x: algos.masked_var(x["a"], MASK),
    "masked_whiten": lambda x: algos.masked_whiten(x["a"], MASK, shift_mean=False),
    "gae": lambda x: algos.gae(x["a"], x["b"], MASK, 0.95, 0.9),
    "reinforce_pp": lambda x: algos.reinforce_pp(x["a"], MASK, 0.9),
    "reinforce_pp_baseline": lambda x: algos.reinforce_pp(x["a"], MASK, 0.9, GROUPS),
    "grpo_from_token_rewards": lambda x: algos.compute_advantages(
        "grpo", token_rewards=x["a"], group_index=GROUPS, mask=MASK
    ),
    "rloo_from_token_rewards": lambda x: algos.compute_advantages(
        "rloo", token_rewards=x["a"], group_index=GROUPS, mask=MASK
    ),
    "kl_k3": lambda x: algos.kl_estimate(x["a"], x["b"], "k3", MASK),
    "kl_penalty": lambda x: algos.apply_kl_penalty(x["a"], x["b"], 0.1, MASK),
    "kl_loss": lambda x: algos.kl_loss(x["a"], x["b"], MASK, 0.1, "k2", "seq-mean-token-mean"),
    "ppo_dual_clip": lambda x: algos.ppo_policy_loss(
        x["a"] * 0.3, x["b"] * 0.3, x["c"], MASK, 0.2, 0.28, 3.0, "seq-mean-token-sum"
    ),
    "value_loss": lambda x: algos.value_loss(x["a"], x["b"], x["c"], MASK, 0.2),
    "entropy_bonus": lambda x: algos.entropy_bonus(x["a"].abs(), MASK, 0.01),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_padding_garbage_changes_nothing(name):
    outs = []
    for garbage in (False, True):
        x = {k: v.requires_grad_(True) for k, v in _inputs(garbage).items()}
        result = CASES[name](x)
        flat = _flatten(result)
        assert flat and all(torch.isfinite(t).all() for t in flat), name
        scalar = sum(t.sum() for t in flat if t.requires_grad)
        grads = []
        if isinstance(scalar, torch.Tensor):
            scalar.backward()
            grads = [x[k].grad if x[k].grad is not None else torch.zeros(B, T) for k in sorted(x)]
            assert all(g[PAD].abs().sum() == 0 for g in grads), f"{name}: grad leaked to padding"
        outs.append([t.detach() for t in flat] + grads)
    clean, dirty = outs
    assert len(clean) == len(dirty)
    for a, b in zip(clean, dirty, strict=True):
        assert torch.equal(a, b), name

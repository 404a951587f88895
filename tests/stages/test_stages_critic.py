"""Critic against its contract: values layout, clipped value loss falls, accumulation."""

from __future__ import annotations

import pytest
import torch
from stage_helpers import make_role, prompt_batch, sequences

from hybridflow.errors import BatchError
from hybridflow.stages.critic import Critic
from hybridflow.stages.rollout.hf import HFRollout


@pytest.fixture(scope="module")
def seqs():
    rollout = make_role(HFRollout, "rollout", {"model": "tiny", "n": 2, "max_new_tokens": 4})
    out, _ = rollout.handle("generate", prompt_batch(), {"step": 0, "mb_id": 0})
    s = sequences(out)
    s["response_mask"][1, 2:] = 0
    return s


def test_values_layout(seqs):
    critic = make_role(Critic, "critic", {"model": "tiny"})
    out, _ = critic.handle("values", seqs, {})
    v, mask = out["values"], seqs["response_mask"].bool()
    assert v.shape == seqs["response_ids"].shape and v.dtype == torch.float32
    assert bool((v[~mask] == 0).all()) and bool(torch.isfinite(v).all())
    # The value of response position t depends on the tokens before it only (causal).
    changed = {**seqs, "response_ids": seqs["response_ids"].clone()}
    changed["response_ids"][:, -1] = 7
    v2 = critic.handle("values", changed, {})[0]["values"]
    assert torch.equal(v[:, :-1], v2[:, :-1])


def test_value_loss_falls_on_a_fixed_target(seqs):
    critic = make_role(Critic, "critic", {"model": "tiny", "lr": 3e-3, "cliprange_value": 0.2})
    returns = torch.linspace(-1.0, 1.0, seqs["response_ids"].numel()).reshape(
        seqs["response_ids"].shape
    )
    returns = returns * seqs["response_mask"]
    losses = []
    for _ in range(6):
        old = critic.handle("values", seqs, {})[0]
        critic.handle("update", {**seqs, **old, "returns": returns}, {})
        m = critic.handle("optimizer_step", {}, {})[1]
        losses.append(m["critic/vf_loss"])
    assert losses[-1] < 0.6 * losses[0]
    assert {"critic/vf_clipfrac", "critic/grad_norm", "critic/lr", "critic/vpred_mean"} <= set(m)
    assert 0.0 <= m["critic/vf_clipfrac"] <= 1.0
    # Without `values` the centre of the clip is computed at first sight.
    critic.handle("update", {**seqs, "returns": returns}, {})
    assert critic.handle("optimizer_step", {}, {})[1]["critic/updates"] == 1.0
    with pytest.raises(BatchError, match="lacks 'returns'"):
        critic.handle("update", seqs, {})
    with pytest.raises(BatchError, match="returns must be float"):
        critic.handle("update", {**seqs, "returns": returns[:, :1]}, {})
    assert set(critic.state_dict()) == {"trainer"}  # weights: critic.save_shards

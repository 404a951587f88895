"""The roles on a CUDA device (skipped without one): sampling, log-prob agreement, reshard,
an update, in float32 and bfloat16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from stage_helpers import prompt_batch, sequences

from hybridflow.stages.actor import Actor
from hybridflow.stages.base import StageContext
from hybridflow.stages.critic import Critic
from hybridflow.stages.reference import Reference
from hybridflow.stages.rollout.hf import HFRollout

pytestmark = pytest.mark.gpu


def _role(cls, options, **kw):
    ctx = StageContext(
        stage="s",
        replica=0,
        device=torch.device("cuda:0"),
        seed=0,
        run_dir=Path("."),
        options=options,
        **kw,
    )
    role = cls()
    role.setup(ctx)
    return role


@pytest.mark.parametrize(
    ("dtype", "amp", "tol"),
    [("float32", False, 1e-3), ("bfloat16", False, 0.1), ("float32", True, 0.1)],
)
def test_roles_on_cuda(dtype, amp, tol):
    model = {"model": "tiny", "dtype": dtype, "autocast_bf16": amp}
    rollout = _role(HFRollout, {**model, "n": 4, "max_new_tokens": 8})
    actor = _role(Actor, {**model, "lr": 1e-3}, colocated={"rollout": rollout})
    ref = _role(Reference, model)
    critic = _role(Critic, model)
    out, _ = rollout.handle("generate", prompt_batch(), {"step": 0, "mb_id": 0})
    assert all(t.device.type == "cpu" for t in out.values())
    seqs = sequences(out)
    lp = actor.handle("get_logprob", seqs, {})[0]["old_logprobs"]
    mask = out["response_mask"].bool()
    assert float((lp - out["rollout_logprobs"])[mask].abs().max()) < tol
    assert torch.equal(lp, ref.handle("get_logprob", seqs, {})[0]["ref_logprobs"])
    values = critic.handle("values", seqs, {})[0]["values"]
    assert values.shape == lp.shape and bool(torch.isfinite(values).all())
    actor.handle("update", {**seqs, "advantages": torch.randn(lp.shape) * mask}, {})
    metrics = actor.handle("optimizer_step", {}, {})[1]
    assert metrics["actor/grad_norm"] > 0
    actor.handle("reshard", {}, {})
    greedy = {"temperature": 0.0, "n": 1}
    after = rollout.handle("generate", prompt_batch(), greedy)[0]
    expected = actor.model.generate(
        input_ids=prompt_batch()["prompt_ids"].cuda(),
        attention_mask=prompt_batch()["prompt_mask"].cuda(),
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=rollout.eos_ids,
        pad_token_id=rollout.pad_id,
    )[:, prompt_batch()["prompt_ids"].shape[1] :].cpu()
    if dtype == "float32" and not amp:  # bf16 greedy may flip on near-ties between code paths
        assert torch.equal(after["response_ids"], expected)

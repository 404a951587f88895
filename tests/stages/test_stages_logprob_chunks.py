"""`logprob_chunk_tokens` (models/head_logprobs.py) in the actor and the reference: an
update with the head in chunks of tokens equals the full-logits path (loss, metrics,
gradients, the parameter update), and so do the no-grad log-probs."""

from __future__ import annotations

import pytest
import torch
from stage_helpers import make_role, prompt_batch, sequences

from hybridflow.errors import ConfigError
from hybridflow.stages.actor import Actor
from hybridflow.stages.reference import Reference
from hybridflow.stages.rollout.hf import HFRollout


@pytest.fixture(scope="module")
def batch():
    rollout = make_role(HFRollout, "rollout", {"model": "tiny", "n": 4, "max_new_tokens": 6})
    out, _ = rollout.handle("generate", prompt_batch(), {"step": 0, "mb_id": 0})
    seqs = sequences(out)
    seqs["response_mask"][::3, 3:] = 0  # uneven lengths
    seqs["response_mask"][1, 1:3] = 0  # an observation inside a multi-turn response
    g = torch.Generator().manual_seed(0)
    seqs["advantages"] = torch.randn(seqs["response_ids"].shape, generator=g)
    return seqs


# eps 1.0: AdamW's first step is then ~ lr * g, linear in the gradient, so float noise in
# near-zero gradients cannot turn into full-size steps of either sign.
ACTOR = {
    "model": "tiny",
    "lr": 1e-2,
    "eps": 1.0,
    "temperature": 0.8,
    "entropy_coef": 0.01,
    "forward_batch_size": 5,
}


@pytest.mark.parametrize("chunk", [1, 7, 1024])
def test_an_update_with_chunks_equals_the_full_logits(batch, chunk):
    ref = make_role(Reference, "ref", {"model": "tiny", "temperature": 0.8})
    ref_lp = ref.handle("get_logprob", batch, {})[0]["ref_logprobs"]
    mb = {**batch, "ref_logprobs": ref_lp - 0.05 * batch["advantages"].abs()}
    roles, metrics, grads = [], [], []
    for c in (0, chunk):
        actor = make_role(Actor, "actor", {**ACTOR, "kl_loss_coef": 0.1, "logprob_chunk_tokens": c})
        got = actor.handle("get_logprob", batch, {})[0]
        roles.append((actor, got))
        metrics.append(actor.handle("update", mb, {})[1])
        grads.append({n: p.grad.clone() for n, p in actor.model.named_parameters()})
    (full, lp0), (chunked, lp1) = roles
    for key in ("old_logprobs", "entropy"):
        torch.testing.assert_close(lp1[key], lp0[key], atol=1e-5, rtol=0)
    for k, v in metrics[0].items():
        assert metrics[1][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=1e-6, rtol=1e-4, msg=n)
    before = {k: v.clone() for k, v in full.model.state_dict().items()}
    m0 = full.handle("optimizer_step", {}, {})[1]
    m1 = chunked.handle("optimizer_step", {}, {})[1]
    assert m1["actor/grad_norm"] == pytest.approx(m0["actor/grad_norm"], rel=1e-5)
    assert m1["actor/pg_loss"] == pytest.approx(m0["actor/pg_loss"], rel=1e-5, abs=1e-7)
    a, b = full.model.state_dict(), chunked.model.state_dict()
    assert any(not torch.equal(a[k], before[k]) for k in a)  # it did train
    for k in a:
        torch.testing.assert_close(b[k] - before[k], a[k] - before[k], atol=1e-7, rtol=1e-4)


def test_sft_update_and_the_reference_with_chunks(batch):
    seqs = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
    out = []
    for c in (0, 3):
        actor = make_role(Actor, "actor", {"model": "tiny", "logprob_chunk_tokens": c})
        ref = make_role(Reference, "ref", {"model": "tiny", "logprob_chunk_tokens": c})
        loss = actor.handle("sft_update", seqs, {})[1]["actor/sft_loss"]
        out.append((loss, ref.handle("get_logprob", seqs, {})[0]["ref_logprobs"]))
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-6)
    torch.testing.assert_close(out[1][1], out[0][1], atol=1e-5, rtol=0)


@pytest.mark.parametrize(("cls", "stage"), [(Actor, "actor"), (Reference, "ref")])
def test_a_negative_chunk_is_refused_with_its_key(cls, stage):
    with pytest.raises(ConfigError, match=rf"stages\.{stage}\.options\.logprob_chunk_tokens"):
        make_role(cls, stage, {"model": "tiny", "logprob_chunk_tokens": -1})

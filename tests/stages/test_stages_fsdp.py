"""FSDP2 ranks on CPU (gloo) equal one process: parameters after several steps, the
step metrics, and checkpoints that move between rank counts."""

from __future__ import annotations

import json

import pytest
import torch
from fsdp_helpers import full_weights, run_ranks, train
from safetensors.torch import load_file
from stage_helpers import make_role, prompt_batch, sequences

from hybridflow.stages.actor import Actor
from hybridflow.stages.critic import Critic
from hybridflow.stages.reference import Reference
from hybridflow.stages.rollout.hf import HFRollout

# fp32 on CPU: the ranks' sums run in another order than one process's, so parameters
# agree to rounding, not bits; AdamW turns a relative gradient error e into an update
# error of about lr * e per step.
ATOL, RTOL = 2e-5, 1e-4


@pytest.fixture(scope="module")
def micro_batches():
    rollout = make_role(HFRollout, "rollout", {"model": "tiny", "n": 4, "max_new_tokens": 6})
    out, _ = rollout.handle("generate", prompt_batch(), {"step": 0, "mb_id": 0})
    seqs = sequences(out)  # 12 rows
    seqs["response_mask"][::3, 3:] = 0  # uneven lengths: token-mean weighting matters
    g = torch.Generator().manual_seed(0)
    seqs["advantages"] = torch.randn(seqs["response_ids"].shape, generator=g)
    seqs["returns"] = torch.randn(seqs["response_ids"].shape, generator=g)
    # Two micro-batches of 6 rows: 3 rows per rank with two ranks.
    return [{k: v[i * 6 : (i + 1) * 6] for k, v in seqs.items()} for i in range(2)]


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=ATOL, rtol=RTOL, msg=k)


ACTOR = {"model": "tiny", "lr": 1e-3, "kl_loss_coef": 0.0, "forward_batch_size": 2}


@pytest.mark.parametrize(
    ("kind", "cls", "options"),
    [
        ("actor", Actor, ACTOR),
        ("actor", Actor, {**ACTOR, "mini_batches": 2, "ppo_epochs": 2}),
        ("critic", Critic, {"model": "tiny", "lr": 1e-3}),
    ],
    ids=["actor", "actor-minibatches-epochs", "critic"],
)
def test_two_ranks_equal_one_process(tmp_path, micro_batches, kind, cls, options):
    steps = 3
    ranked, metrics = run_ranks(2, kind, options, micro_batches, steps, tmp_path)
    one = make_role(cls, kind, options)
    single = train(one, micro_batches, steps)
    before = full_weights(make_role(cls, kind, options))
    after = full_weights(one)
    assert any(not torch.equal(before[k], after[k]) for k in after)  # it did train
    _close(ranked, after)
    # Step metrics are global (summed over the ranks), not rank 0's share.
    for m2, m1 in zip(metrics, single, strict=True):
        assert m2.keys() == m1.keys()
        for k in m1:
            assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k


def test_checkpoints_move_between_rank_counts(tmp_path, micro_batches):
    opts = ACTOR
    # One process trains a step and writes a checkpoint (weights + moments as shards).
    one = make_role(Actor, "actor", opts)
    train(one, micro_batches, 1)
    ck1 = tmp_path / "ck1"
    extra = one.save_shards(ck1 / "shards")
    (ck1 / "state.json").write_text(json.dumps({"extra": extra}))
    train(one, micro_batches, 2)
    expected = full_weights(one)  # one process, 3 steps

    # Two ranks resume it and run steps 2 and 3: the same parameters.
    ranked, _ = run_ranks(
        2, "actor", opts, micro_batches, 2, tmp_path / "r2", load_from=ck1, save_to=tmp_path / "ck2"
    )
    _close(ranked, expected)

    # One process resumes the two ranks' checkpoint (written after step 3) exactly: its
    # weights are the ranks' weights bit for bit.
    back = make_role(Actor, "actor", {**opts, "init_seed": 7})
    state = json.loads((tmp_path / "ck2" / "state.json").read_text())
    back.load_shards(tmp_path / "ck2" / "shards", state["extra"])
    got = full_weights(back)
    assert all(torch.equal(got[k], ranked[k]) for k in ranked)
    # ...and the AdamW moments came along: one more step matches the reference's.
    train(back, micro_batches, 1)
    train(one, micro_batches, 1)
    _close(full_weights(back), full_weights(one))


def test_a_sharded_reference_gives_the_log_probs_of_one_process(tmp_path, micro_batches):
    """`fsdp: true` shards the frozen reference too: each rank computes its rows' log-probs
    with all-gathered layers; together they are one process's."""
    opts = {"model": "tiny", "fsdp": True}
    weights, _ = run_ranks(2, "reference", opts, micro_batches, 0, tmp_path)
    one = make_role(Reference, "reference", {"model": "tiny"})
    assert all(torch.equal(weights[k], v) for k, v in full_weights(one).items())
    parts = [load_file(str(tmp_path / f"ref{r}.safetensors")) for r in range(2)]
    for i, mb in enumerate(micro_batches):
        got = torch.cat([p[f"mb{i}"] for p in parts])
        want = one.handle("get_logprob", mb, {})[0]["ref_logprobs"]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

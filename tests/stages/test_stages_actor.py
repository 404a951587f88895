"""Actor and Reference against their contracts (setup/handle called directly, tiny model)."""

from __future__ import annotations

import pytest
import torch
from stage_helpers import PROMPTS, TOK, make_role, prompt_batch, sequences

from hybridflow.data import collate_sft
from hybridflow.errors import BatchError, ConfigError
from hybridflow.stages.actor import Actor
from hybridflow.stages.common import training_attention
from hybridflow.stages.reference import Reference
from hybridflow.stages.rollout.hf import HFRollout
from hybridflow.stages.trainer import TrainOptions, lr_factor


@pytest.fixture(scope="module")
def rollout_out():
    rollout = make_role(HFRollout, "rollout", {"model": "tiny", "n": 4, "max_new_tokens": 5})
    out, _ = rollout.handle("generate", prompt_batch(), {"step": 0, "mb_id": 0})
    seqs = sequences(out)
    # Uneven response lengths, so token-mean weighting is exercised.
    seqs["response_mask"][::3, 3:] = 0
    return seqs


def _advantages(seqs, seed=0):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(seqs["response_ids"].shape, generator=g)
    return adv * seqs["response_mask"]


def _params(role):
    return {k: v.detach().clone() for k, v in role.model.state_dict().items()}


def test_reference_equals_actor_before_any_update(rollout_out):
    actor = make_role(Actor, "actor", {"model": "tiny"})
    ref = make_role(Reference, "ref", {"model": "tiny"})
    a, _ = actor.handle("get_logprob", rollout_out, {})
    r, _ = ref.handle("get_logprob", rollout_out, {})
    assert torch.equal(a["old_logprobs"], r["ref_logprobs"])
    mask = rollout_out["response_mask"].bool()
    assert bool((a["old_logprobs"][~mask] == 0).all()) and bool((a["old_logprobs"][mask] < 0).all())
    assert bool((a["entropy"][mask] > 0).all()) and bool((a["entropy"][~mask] == 0).all())
    assert ref.state_dict() == {}
    with pytest.raises(BatchError, match="unknown op"):
        ref.handle("update", rollout_out, {})


def test_update_with_positive_advantage_raises_that_tokens_probability():
    actor = make_role(Actor, "actor", {"model": "tiny", "lr": 1e-2})
    batch = prompt_batch()
    target = TOK("7", add_special_tokens=False)["input_ids"][0]
    batch["response_ids"] = torch.tensor([[target, 5]] * 3)
    batch["response_mask"] = torch.ones(3, 2, dtype=torch.int64)
    adv = torch.zeros(3, 2)
    adv[:, 0] = 1.0  # reward only the first token
    before, _ = actor.handle("get_logprob", batch, {})
    _, mb_metrics = actor.handle("update", {**batch, "advantages": adv}, {})
    _, metrics = actor.handle("optimizer_step", {}, {})
    after, _ = actor.handle("get_logprob", batch, {})
    assert bool((after["old_logprobs"][:, 0] > before["old_logprobs"][:, 0] + 0.05).all())
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/lr"] == 1e-2
    assert metrics["actor/pg_loss"] == pytest.approx(mb_metrics["actor/pg_loss"])
    assert metrics["actor/pg_clipfrac"] == 0.0  # one epoch: ratio is exactly 1
    assert metrics["actor/policy_version"] == 1.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_split_gives_the_same_gradient(rollout_out, agg):
    opts = {"model": "tiny", "lr": 1e-3, "loss_agg_mode": agg, "entropy_coef": 0.01}
    batch = {**rollout_out, "advantages": _advantages(rollout_out)}
    whole = make_role(Actor, "actor", opts)
    split = make_role(Actor, "actor", {**opts, "forward_batch_size": 5})
    whole.handle("update", batch, {})
    split.handle("update", {k: v[:3] for k, v in batch.items()}, {})
    split.handle("update", {k: v[3:] for k, v in batch.items()}, {})

    # The gradient the optimizer will see (sum form / the whole step's denominator).
    # Compared before AdamW: Adam's m / sqrt(v) turns float noise in near-zero
    # gradients into full-size steps, so parameters after it are not a fair comparison.
    def grads(role):
        return {n: p.grad / role.trainer._denom for n, p in role.model.named_parameters()}

    ga, gb = grads(whole), grads(split)
    assert all(torch.allclose(ga[k], gb[k], rtol=1e-4, atol=1e-8) for k in ga)
    m1 = whole.handle("optimizer_step", {}, {})[1]
    m2 = split.handle("optimizer_step", {}, {})[1]
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-7)


def test_ppo_epochs_and_mini_batches_map_onto_updates(rollout_out):
    batch = {**rollout_out, "advantages": _advantages(rollout_out)}
    thirds = [{k: v[i::3] for k, v in batch.items()} for i in range(3)]
    epochs = make_role(Actor, "actor", {"model": "tiny", "ppo_epochs": 3, "lr": 1e-2})
    for mb in thirds:
        assert epochs.handle("update", mb, {})[1]  # streamed: metrics now
    m = epochs.handle("optimizer_step", {}, {})[1]
    assert m["actor/updates"] == 3.0
    assert m["actor/pg_clipfrac"] > 0  # later epochs move the ratio away from 1
    assert m["actor/ppo_kl"] != 0.0
    minis = make_role(Actor, "actor", {"model": "tiny", "ppo_epochs": 2, "mini_batches": 2})
    for mb in thirds:
        assert minis.handle("update", mb, {})[1] == {}  # kept for optimizer_step
    assert minis.handle("optimizer_step", {}, {})[1]["actor/updates"] == 4.0
    too_many = make_role(Actor, "actor", {"model": "tiny", "mini_batches": 4})
    for mb in thirds:
        too_many.handle("update", mb, {})
    with pytest.raises(BatchError, match="cannot form mini_batches=4"):
        too_many.handle("optimizer_step", {}, {})


def test_kl_loss_and_input_errors(rollout_out):
    actor = make_role(Actor, "actor", {"model": "tiny", "kl_loss_coef": 0.1})
    batch = {**rollout_out, "advantages": _advantages(rollout_out)}
    with pytest.raises(BatchError, match="optimizer_step without any update"):
        actor.handle("optimizer_step", {}, {})
    with pytest.raises(BatchError, match="needs `ref_logprobs`"):
        actor.handle("update", batch, {})
    ref = make_role(Reference, "ref", {"model": "tiny"}).handle("get_logprob", rollout_out, {})[0]
    metrics = actor.handle("update", {**batch, **ref}, {})[1]
    assert metrics["actor/kl"] == pytest.approx(0.0, abs=1e-7)  # nothing moved yet
    with pytest.raises(BatchError, match="advantages is"):
        actor.handle("update", {**batch, **ref, "advantages": batch["advantages"][:, :2]}, {})
    nan = batch["advantages"].clone()
    nan[0, 0] = float("nan")
    with pytest.raises(BatchError, match="NaN"):
        actor.handle("update", {**batch, **ref, "advantages": nan}, {})
    with pytest.raises(BatchError, match="lacks"):
        actor.handle("update", {"prompt_ids": batch["prompt_ids"]}, {})
    with pytest.raises(BatchError, match="unknown op"):
        actor.handle("generate", batch, {})
    with pytest.raises(BatchError, match="no colocated rollout"):
        actor.handle("reshard", {}, {})
    with pytest.raises(ConfigError, match=r"stages\.actor\.options\.total_steps"):
        make_role(Actor, "actor", {"model": "tiny", "lr_schedule": "cosine", "warmup_steps": 2})


def test_lr_schedule_warmup_and_decay():
    opts = TrainOptions(
        lr=1.0, warmup_steps=2, lr_schedule="cosine", total_steps=6, min_lr_ratio=0.1
    )
    factors = [lr_factor(opts, s) for s in range(8)]
    assert factors[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert factors[4] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert factors[6:] == pytest.approx([0.1, 0.1])
    actor = make_role(Actor, "actor", {"model": "tiny", "lr": 1e-3, "warmup_steps": 2})
    sft = collate_sft([{"prompt": p, "response": "1"} for p in PROMPTS], TOK)
    lrs = []
    for _ in range(3):
        actor.handle("sft_update", sft, {})
        lrs.append(actor.handle("optimizer_step", {}, {})[1]["actor/lr"])
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3])


def test_state_dict_round_trip_resumes_identically(rollout_out, tmp_path):
    batch = {**rollout_out, "advantages": _advantages(rollout_out)}
    opts = {"model": "tiny", "lr": 1e-3, "mini_batches": 2, "warmup_steps": 3}
    a = make_role(Actor, "actor", opts)
    halves = [{k: v[i::2] for k, v in batch.items()} for i in range(2)]
    for mb in halves:
        a.handle("update", mb, {})
    a.handle("optimizer_step", {}, {})
    # Weights and AdamW moments travel as (DCP) shards, the rest as the role's state.
    extra = a.save_shards(tmp_path / "shards")
    state = a.state_dict()
    assert "model" not in state and "optimizer" not in state["trainer"]
    b = make_role(Actor, "actor", {**opts, "init_seed": 5})
    b.load_shards(tmp_path / "shards", extra)
    b.load_state_dict(state)
    assert b.version == 1
    for role in (a, b):
        for mb in halves:
            role.handle("update", mb, {})
    ma, mb_ = a.handle("optimizer_step", {}, {})[1], b.handle("optimizer_step", {}, {})[1]
    pa, pb = _params(a), _params(b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert ma == mb_
    a.handle("update", halves[0], {})
    with pytest.raises(BatchError, match="middle of a step"):
        a.state_dict()


def test_sft_update_lowers_the_response_nll():
    actor = make_role(Actor, "actor", {"model": "tiny", "lr": 3e-3})
    sft = collate_sft([{"prompt": p, "response": "odd"} for p in PROMPTS], TOK)
    losses = []
    for _ in range(4):
        actor.handle("sft_update", sft, {})
        losses.append(actor.handle("optimizer_step", {}, {})[1]["actor/sft_loss"])
    assert losses[-1] < losses[0] - 0.5


# -- algorithms: policy losses, Dr. GRPO aggregation, rollout correction, sample_mask ----


def _grads(role):
    return {n: p.grad / role.trainer._denom for n, p in role.model.named_parameters()}


@pytest.mark.parametrize(
    "extra",
    [
        {"policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-mean"},
        {"policy_loss": "cispo", "clip_ratio_low": 0.9, "clip_ratio_high": 2.0},
        {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_norm_len": 5},
        {"kl_loss_coef": 0.05, "kl_loss_type": "k3+"},
    ],
)
def test_policy_losses_train_and_split_like_one_batch(rollout_out, extra):
    opts = {"model": "tiny", "lr": 1e-3, **extra}
    ref = make_role(Reference, "ref", {"model": "tiny"}).handle("get_logprob", rollout_out, {})[0]
    batch = {**rollout_out, **ref, "advantages": _advantages(rollout_out)}
    whole = make_role(Actor, "actor", opts)
    split = make_role(Actor, "actor", {**opts, "forward_batch_size": 5})
    whole.handle("update", batch, {})
    split.handle("update", {k: v[:3] for k, v in batch.items()}, {})
    split.handle("update", {k: v[3:] for k, v in batch.items()}, {})
    ga, gb = _grads(whole), _grads(split)
    assert all(torch.allclose(ga[k], gb[k], rtol=1e-4, atol=1e-8) for k in ga)
    assert any(bool(g.abs().sum() > 0) for g in ga.values())
    m = whole.handle("optimizer_step", {}, {})[1]
    assert m["actor/pg_clipfrac"] == 0.0 and m["actor/updates"] == 1.0


def test_sample_mask_rows_leave_the_loss_and_its_denominator(rollout_out):
    batch = {**rollout_out, "advantages": _advantages(rollout_out)}
    n = batch["response_ids"].shape[0]
    keep = torch.tensor([i % 3 != 1 for i in range(n)], dtype=torch.float32)
    masked = make_role(Actor, "actor", {"model": "tiny"})
    subset = make_role(Actor, "actor", {"model": "tiny"})
    masked.handle("update", {**batch, "sample_mask": keep}, {})
    subset.handle("update", {k: v[keep.bool()] for k, v in batch.items()}, {})
    ga, gb = _grads(masked), _grads(subset)
    assert all(torch.allclose(ga[k], gb[k], rtol=1e-4, atol=1e-8) for k in ga)
    # a micro-batch whose rows were all dropped adds nothing (and does not fail)
    empty = make_role(Actor, "actor", {"model": "tiny"})
    empty.handle("update", {**batch, "sample_mask": torch.zeros(n)}, {})
    assert empty.trainer._denom == 0


def test_rollout_correction_weights_and_metrics(rollout_out):
    g = torch.Generator().manual_seed(1)
    mask = rollout_out["response_mask"]
    actor_lp = make_role(Actor, "actor", {"model": "tiny"}).handle("get_logprob", rollout_out, {})[
        0
    ]["old_logprobs"]
    noisy = (actor_lp + 0.3 * torch.randn(actor_lp.shape, generator=g)) * mask
    batch = {
        **rollout_out,
        "advantages": _advantages(rollout_out),
        "old_logprobs": actor_lp,
        "rollout_logprobs": noisy,
    }
    for mode in ("tis", "mis"):
        actor = make_role(Actor, "actor", {"model": "tiny", "rollout_correction": mode})
        m = actor.handle("update", batch, {})[1]
        for key in ("mismatch_kl", "mismatch_k3", "weight_mean", "weight_max", "masked_frac"):
            assert f"actor/rollout_corr/{key}" in m, (mode, key)
        assert m["actor/rollout_corr/mismatch_k3"] > 0
    # no mismatch: the correction is the identity, the gradient the uncorrected one
    same = {**batch, "rollout_logprobs": actor_lp}
    a = make_role(Actor, "actor", {"model": "tiny", "rollout_correction": "tis"})
    b = make_role(Actor, "actor", {"model": "tiny"})
    a.handle("update", same, {})
    b.handle("update", same, {})
    ga, gb = _grads(a), _grads(b)
    assert all(torch.allclose(ga[k], gb[k], rtol=1e-5, atol=1e-9) for k in ga)
    with pytest.raises(BatchError, match="lacks 'rollout_logprobs'"):
        a.handle("update", {k: v for k, v in batch.items() if k != "rollout_logprobs"}, {})


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"loss_agg_mode": "seq-mean-token-sum-norm"}, "loss_norm_len"),
        (
            {"rollout_correction": "tis", "old_logprob_key": "rollout_logprobs"},
            "rollout_logprob_key",
        ),
        ({"policy_loss": "gspo", "dual_clip_c": 3.0}, "dual_clip_c"),
        ({"kl_loss_type": "k4"}, "kl_loss_type"),
        ({"policy_loss": "grpo"}, "policy_loss"),
    ],
)
def test_algorithm_options_are_checked_with_their_key(options, key):
    with pytest.raises(ConfigError, match=rf"stages\.actor\.options\.{key}"):
        make_role(Actor, "actor", {"model": "tiny", **options})


def test_a_step_with_every_row_dropped_applies_no_update(rollout_out, recwarn):
    n = rollout_out["response_ids"].shape[0]
    batch = {**rollout_out, "advantages": _advantages(rollout_out), "sample_mask": torch.zeros(n)}
    actor = make_role(Actor, "actor", {"model": "tiny"})
    before = _params(actor)
    actor.handle("update", batch, {})
    m = actor.handle("optimizer_step", {}, {})[1]
    assert m["actor/updates"] == 0.0 and m["actor/policy_version"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in actor.model.state_dict().items())
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message)]


def test_training_attention_takes_cudnn_sdpa_out_on_a_gpu_only():
    """A trainable role's setup (common.training_attention; the GPU test in
    test_stages_gpu.py runs the update it protects): cuDNN's SDPA off for a CUDA device,
    the process untouched for the CPU."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        training_attention(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        training_attention(torch.device("cuda"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)

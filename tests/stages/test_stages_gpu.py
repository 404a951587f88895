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


@pytest.mark.parametrize("offload", [False, True], ids=["on-gpu", "cpu-offload"])
def test_fsdp_world_size_one_on_cuda_matches_the_plain_actor(tmp_path, offload):
    """`fsdp: true` on one GPU runs the sharded code path (NCCL group of one, DTensor
    parameters, bf16 compute policy off here; with `fsdp_cpu_offload` the shards, their
    gradients and the AdamW state live on the host) and trains like the plain actor; its
    checkpoint shards load back into a plain actor, and colocated reshard still works."""
    rollout = _role(HFRollout, {"model": "tiny", "n": 4, "max_new_tokens": 6})
    out, _ = rollout.handle("generate", prompt_batch(), {"step": 0, "mb_id": 0})
    seqs = sequences(out)
    seqs["advantages"] = torch.randn(
        seqs["response_ids"].shape, generator=torch.Generator().manual_seed(0)
    )
    opts = {"model": "tiny", "lr": 1e-3}
    plain = _role(Actor, opts)
    sharded = _role(
        Actor, {**opts, "fsdp": True, "fsdp_cpu_offload": offload}, colocated={"rollout": rollout}
    )
    assert sharded.is_sharded and not plain.is_sharded
    for _ in range(2):
        for role in (plain, sharded):
            role.handle("update", seqs, {})
            role.handle("optimizer_step", {}, {})
    a = dict(plain.named_full_weights())
    b = dict(sharded.named_full_weights())
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4, msg=k)
    extra = sharded.save_shards(tmp_path / "shards")
    back = _role(Actor, {**opts, "init_seed": 3})
    back.load_shards(tmp_path / "shards", extra)
    assert all(torch.equal(v, b[k]) for k, v in back.named_full_weights())
    sharded.handle("reshard", {}, {})  # gathered weights into the colocated rollout
    for name, p in rollout.model.named_parameters():
        assert torch.equal(p.detach(), b[name]), name


@pytest.mark.multigpu
def test_two_gpu_ranks_equal_one_gpu(tmp_path):
    """FSDP2 over NCCL on cuda:0 and cuda:1 against the plain actor on cuda:0 (fp32, no
    mixed precision): the same parameters after three steps, to rounding."""
    from fsdp_helpers import run_ranks, train

    rollout = _role(HFRollout, {"model": "tiny", "n": 4, "max_new_tokens": 6})
    out, _ = rollout.handle("generate", prompt_batch(), {"step": 0, "mb_id": 0})
    seqs = {k: v.cpu() for k, v in sequences(out).items()}
    seqs["response_mask"][::3, 3:] = 0
    seqs["advantages"] = torch.randn(
        seqs["response_ids"].shape, generator=torch.Generator().manual_seed(0)
    )
    mbs = [{k: v[i * 6 : (i + 1) * 6] for k, v in seqs.items()} for i in range(2)]
    opts = {"model": "tiny", "lr": 1e-3}
    ranked, _ = run_ranks(2, "actor", opts, mbs, 3, tmp_path, cuda=True)
    one = _role(Actor, opts)
    train(one, mbs, 3)
    for k, v in one.named_full_weights():
        torch.testing.assert_close(ranked[k], v.cpu(), atol=2e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("width", [192, 320])  # 64 mod 128: the widths cuDNN's bug needs
def test_a_bf16_update_of_left_padded_rows_has_a_finite_gradient(width):
    """A trainable role's setup takes cuDNN's SDPA out (common.training_attention): its
    backward gave NaN dQ for a masked forward whose length is 64 mod 128 when a query row
    is fully masked, as every left-padded prompt position is (pytorch#196678; seen as
    every qwen2-1.5b update skipped on an H100, torch 2.11). Rows here: a long prompt and
    a short one (left padding), responses to a width of 64 mod 128."""
    actor = _role(Actor, {"model": "small", "dtype": "bfloat16", "lr": 1e-4})
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    g = torch.Generator().manual_seed(width)
    p, r = 64, width - 64
    prompt_mask = torch.ones(2, p, dtype=torch.int64)
    prompt_mask[1, : p - 5] = 0  # 59 fully masked query rows
    response_mask = torch.ones(2, r, dtype=torch.int64)
    batch = {
        "prompt_ids": torch.randint(3, 190, (2, p), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "response_ids": torch.randint(3, 190, (2, r), generator=g),  # vocabulary: 192
        "response_mask": response_mask,
        "advantages": torch.randn(2, r, generator=g),
    }
    actor.handle("update", batch, {})
    metrics = actor.handle("optimizer_step", {}, {})[1]
    assert metrics["actor/skipped_updates"] == 0
    assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"]))

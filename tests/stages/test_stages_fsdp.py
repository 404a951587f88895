"""FSDP2 ranks on CPU (gloo) equal one process: parameters after several steps, the
step metrics, and checkpoints that move between rank counts; a sharded reference; a
LoRA actor's adapters (moved here from test_stages_lora.py to share the ranks).

The ranks are spawned once for the whole module (`ranked`: every test's job, run one
after another on the same two processes); each test then checks its job's results
against one process."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from fsdp_helpers import Job, full_weights, run_jobs, sync_payloads, train
from safetensors.torch import load_file
from stage_helpers import make_role, prompt_batch, sequences

from hybridflow.models.lora import is_adapter
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
LORA = {"model": "tiny", "lr": 1e-3, "lora_rank": 4, "lora_alpha": 8.0, "forward_batch_size": 2}
LORA_SYNC = {**LORA, "lora_sync": "adapters"}
STEPS = 3
HAS_PEFT = importlib.util.find_spec("peft") is not None
EQUAL = {  # test_two_ranks_equal_one_process's variants
    "actor": (Actor, ACTOR),
    "actor-minibatches-epochs": (Actor, {**ACTOR, "mini_batches": 2, "ppo_epochs": 2}),
    "critic": (Critic, {"model": "tiny", "lr": 1e-3}),
}


@pytest.fixture(scope="module")
def ranked(tmp_path_factory, micro_batches):
    """Every test's job on one spawn of two gloo ranks -> {job: (weights, metrics)},
    plus the one-process actor that wrote the checkpoint the "resume" job starts from."""
    root = tmp_path_factory.mktemp("ranks")
    # One process trains a step and writes a checkpoint (weights + moments as shards).
    one = make_role(Actor, "actor", ACTOR)
    train(one, micro_batches, 1)
    ck1 = root / "ck1"
    extra = one.save_shards(ck1 / "shards")
    (ck1 / "state.json").write_text(json.dumps({"extra": extra}))
    jobs = {
        name: Job(name.split("-")[0], opts, micro_batches, STEPS, root / name)
        for name, (_, opts) in EQUAL.items()
    }
    # Two ranks resume it and run steps 2 and 3, then checkpoint.
    jobs["resume"] = Job("actor", ACTOR, micro_batches, 2, root / "resume", ck1, root / "ck2")
    jobs["reference"] = Job(
        "reference", {"model": "tiny", "fsdp": True}, micro_batches, 0, root / "reference"
    )
    if HAS_PEFT:
        jobs["lora"] = Job(
            "actor", LORA, micro_batches, STEPS, root / "lora", save_to=root / "lora-ck"
        )
        jobs["lora-sync"] = Job(
            "actor", LORA_SYNC, micro_batches, STEPS, root / "lora-sync", syncs=True
        )
    results = run_jobs(2, list(jobs.values()))
    out = dict(zip(jobs, results, strict=True))
    out["one"] = one
    out["jobs"] = jobs
    return out


@pytest.mark.parametrize("variant", list(EQUAL))
def test_two_ranks_equal_one_process(ranked, micro_batches, variant):
    cls, options = EQUAL[variant]
    kind = variant.split("-")[0]
    ranked_weights, metrics = ranked[variant]
    one = make_role(cls, kind, options)
    single = train(one, micro_batches, STEPS)
    before = full_weights(make_role(cls, kind, options))
    after = full_weights(one)
    assert any(not torch.equal(before[k], after[k]) for k in after)  # it did train
    _close(ranked_weights, after)
    # Step metrics are global (summed over the ranks), not rank 0's share.
    for m2, m1 in zip(metrics, single, strict=True):
        assert m2.keys() == m1.keys()
        for k in m1:
            assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k


def test_checkpoints_move_between_rank_counts(ranked, micro_batches):
    opts = ACTOR
    one = ranked["one"]  # one process after a step; its checkpoint is the job's load_from
    train(one, micro_batches, 2)
    expected = full_weights(one)  # one process, 3 steps

    # Two ranks resumed it and ran steps 2 and 3: the same parameters.
    weights, _ = ranked["resume"]
    _close(weights, expected)

    # One process resumes the two ranks' checkpoint (written after step 3) exactly: its
    # weights are the ranks' weights bit for bit.
    ck2 = ranked["jobs"]["resume"].save_to
    back = make_role(Actor, "actor", {**opts, "init_seed": 7})
    state = json.loads((ck2 / "state.json").read_text())
    back.load_shards(ck2 / "shards", state["extra"])
    got = full_weights(back)
    assert all(torch.equal(got[k], weights[k]) for k in weights)
    # ...and the AdamW moments came along: one more step matches the reference's.
    train(back, micro_batches, 1)
    train(one, micro_batches, 1)
    _close(full_weights(back), full_weights(one))


def test_a_sharded_reference_gives_the_log_probs_of_one_process(ranked, micro_batches):
    """`fsdp: true` shards the frozen reference too: each rank computes its rows' log-probs
    with all-gathered layers; together they are one process's."""
    weights, _ = ranked["reference"]
    out = ranked["jobs"]["reference"].out
    one = make_role(Reference, "reference", {"model": "tiny"})
    assert all(torch.equal(weights[k], v) for k, v in full_weights(one).items())
    parts = [load_file(str(out / f"ref{r}.safetensors")) for r in range(2)]
    for i, mb in enumerate(micro_batches):
        got = torch.cat([p[f"mb{i}"] for p in parts])
        want = one.handle("get_logprob", mb, {})[0]["ref_logprobs"]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_two_fsdp_ranks_train_the_adapters_as_one_process_does(ranked, micro_batches):
    """LoRA (issue 24) under FSDP: the ranks train the adapters only, as one process does,
    and their checkpoint (adapters only) loads into one process."""
    if not HAS_PEFT:
        pytest.skip("needs peft")
    weights, _ = ranked["lora"]
    one = make_role(Actor, "actor", LORA)
    train(one, micro_batches, STEPS)
    after, before = full_weights(one), full_weights(make_role(Actor, "actor", LORA))
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed), sorted(changed)[:4]
    _close(weights, after)
    # The ranks' checkpoint (adapters only) loads into one process: the ranks' weights.
    ck = ranked["jobs"]["lora"].save_to
    back = make_role(Actor, "actor", LORA)
    state = json.loads((ck / "state.json").read_text())
    back.load_shards(ck / "shards", state["extra"])
    got = full_weights(back)
    assert all(torch.equal(got[k], weights[k]) for k in weights)


def _stream(role) -> dict[str, torch.Tensor]:
    """One stream update of a one-process actor, every bucket merged (copies)."""
    return {k: v.detach().clone() for b in role.weight_buckets() for k, v in b.items()}


def test_two_fsdp_ranks_stream_the_model_once_then_the_adapters_one_process_has(
    ranked, micro_batches
):
    """`lora_sync: adapters` under FSDP (issue 24): every rank's first stream update is the
    whole wrapped model, gathered, bit for bit one process's; after the steps each rank
    sends the lora_A / lora_B tensors only, whole (every rank gathers them), equal on both
    ranks and to what one process sends after the same steps."""
    if not HAS_PEFT:
        pytest.skip("needs peft")
    job = ranked["jobs"]["lora-sync"]
    one = make_role(Actor, "actor", LORA_SYNC)
    first_one = _stream(one)
    train(one, micro_batches, STEPS)
    last_one = _stream(one)
    adapters = {k for k in first_one if is_adapter(k)}
    assert adapters and adapters != first_one.keys()  # the first update holds the base too
    assert last_one.keys() == adapters
    assert any(not torch.equal(last_one[k], first_one[k]) for k in adapters)  # it trained
    for payload in sync_payloads(job, 2, "first"):
        assert payload.keys() == first_one.keys()
        assert all(torch.equal(payload[k], first_one[k]) for k in payload)
    last = sync_payloads(job, 2, "last")
    for payload in last:
        assert all(torch.equal(payload[k], last[0][k]) for k in payload)
        _close(payload, last_one)
    # What the ranks sent is what they hold: their trained adapters, gathered.
    weights, _ = ranked["lora-sync"]
    assert all(torch.equal(last[0][k], weights[k]) for k in adapters)
    sent = sum(t.numel() * t.element_size() for t in last[0].values())
    assert sent * 5 < sum(t.numel() * t.element_size() for t in first_one.values())

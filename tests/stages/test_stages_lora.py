"""LoRA on the trainer roles (issue 24), set up and driven directly on the tiny model:
only adapters train, the reference from the same weights, merged weights for the
rollout, checkpoints of adapters only, the PEFT export, and the bad-input messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from stage_helpers import make_role, prompt_batch, sequences

from hybridflow.errors import ConfigError
from hybridflow.models import ModelOptions, builtin_tokenizer, load_model
from hybridflow.stages.actor import Actor
from hybridflow.stages.common import response_logprobs
from hybridflow.stages.critic import Critic
from hybridflow.stages.reference import Reference
from hybridflow.stages.rollout.hf import HFRollout

peft = pytest.importorskip("peft")

LORA = {"model": "tiny", "lr": 1e-2, "lora_rank": 4, "lora_alpha": 8.0}


@pytest.fixture(scope="module")
def seqs():
    rollout = make_role(HFRollout, "rollout", {"model": "tiny", "n": 4, "max_new_tokens": 5})
    out, _ = rollout.handle("generate", prompt_batch(), {"step": 0, "mb_id": 0})
    s = sequences(out)
    s["response_mask"][::3, 3:] = 0
    g = torch.Generator().manual_seed(0)
    s["advantages"] = torch.randn(s["response_ids"].shape, generator=g) * s["response_mask"]
    s["returns"] = torch.randn(s["response_ids"].shape, generator=g)
    return s


def _train(role, batch, steps=2):
    for _ in range(steps):
        role.handle("update", batch, {})
        role.handle("optimizer_step", {}, {})


def _state(role):
    return {k: v.detach().clone() for k, v in role.model.state_dict().items()}


def test_only_adapter_parameters_train_and_hold_optimizer_state(seqs):
    actor = make_role(Actor, "actor", LORA)
    before = _state(actor)
    _train(actor, seqs)
    after = _state(actor)
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    assert changed, "nothing trained"
    assert all(".lora_A." in k or ".lora_B." in k for k in changed), sorted(changed)[:4]
    # B starts at zero and A gets a gradient through it only after B moved: both moved.
    assert any(".lora_A." in k for k in changed) and any(".lora_B." in k for k in changed)
    opt = actor.trainer.optimizer
    held = {id(p) for p in opt.state}
    names = {id(p): n for n, p in actor.model.named_parameters()}
    assert held and all("lora_" in names[i] for i in held)


# The actor's gradient_checkpointing_enable() is deprecated by transformers 5.24 (a name
# change; it still works): the actor's to update, not this test's subject.
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
def test_lora_dropout_acts_in_the_update_only_and_checkpointing_keeps_adapter_grads(seqs):
    actor = make_role(Actor, "actor", {**LORA, "lora_dropout": 0.5})
    _train(actor, seqs, steps=1)  # B off zero: dropout on the adapter input now matters
    a, _ = actor.handle("get_logprob", seqs, {})
    b, _ = actor.handle("get_logprob", seqs, {})
    assert torch.equal(a["old_logprobs"], b["old_logprobs"])  # no grad: deterministic
    with torch.enable_grad():
        lp, _ = response_logprobs(actor.model, seqs, torch.device("cpu"))
    assert not torch.allclose(lp.detach(), a["old_logprobs"])  # with grad: dropped out
    ckpt = make_role(Actor, "actor", {**LORA, "gradient_checkpointing": True})
    before = _state(ckpt)
    _train(ckpt, seqs, steps=1)
    after = _state(ckpt)
    assert any(not torch.equal(before[k], after[k]) for k in after if ".lora_B." in k)


def test_a_lora_critic_trains_adapters_and_its_value_head(seqs):
    critic = make_role(Critic, "critic", {"model": "tiny", "lr": 1e-2, "lora_rank": 4})
    before = _state(critic)
    _train(critic, seqs, steps=1)
    after = _state(critic)
    changed = {k for k in after if not torch.equal(before[k], after[k])}
    assert {"score.weight"} <= changed
    assert all("lora_" in k or k.startswith("score.") for k in changed), sorted(changed)


def test_a_target_that_matches_nothing_names_the_option_and_the_linear_layers():
    with pytest.raises(ConfigError) as err:
        make_role(Actor, "actor", {**LORA, "lora_target_modules": ["qkv_proj"]})
    text = str(err.value)
    assert "lora_target_modules" in text and "'qkv_proj'" in text
    assert "q_proj" in text and "down_proj" in text and "lm_head" not in text


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("lora_rank", -1, "must be >= 0"),
        ("lora_alpha", 0.0, "must be > 0"),
        ("lora_dropout", 1.0, r"\[0, 1\)"),
        ("lora_target_modules", "all", "all-linear"),
    ],
)
def test_bad_lora_options_name_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message) as err:
        make_role(Actor, "actor", {**LORA, key: value})
    assert key in str(err.value)


def test_lora_on_a_role_that_does_not_train_is_a_config_error():
    from hybridflow.config.schema import load_topology
    from hybridflow.pipeline.plan.planner import build_plan

    for role in ("reference", "rollout"):
        topo = load_topology("grpo", [f"stages.engine.roles.{role}.options.lora_rank=8"])
        with pytest.raises(ConfigError, match="trains nothing") as err:
            build_plan(topo)
        assert f"roles.{role}.options.lora_rank" in str(err.value)


def _colocated(actor_opts, ref_opts=None):
    """An actor and a reference in one process, as the stage host sets them up."""
    roles = {"actor": Actor(), "reference": Reference()}
    from hybridflow.stages.base import StageContext, StageWorld

    for name, opts in (("reference", ref_opts or {"model": "tiny"}), ("actor", actor_opts)):
        ctx = StageContext(
            stage="engine",
            replica=0,
            device=torch.device("cpu"),
            seed=0,
            run_dir=Path("/nonexistent"),
            options=opts,
            colocated=roles,
            world=StageWorld(role=name),
        )
        roles[name].setup(ctx)  # the reference first: it must wait for the actor
    for role in roles.values():
        if hasattr(role, "bind_colocated"):
            role.bind_colocated()
    return roles["actor"], roles["reference"]


def test_the_reference_of_a_lora_actor_is_its_base_with_adapters_disabled(seqs):
    actor, ref = _colocated(LORA)
    assert ref.model is actor.model  # no second model in memory
    _train(actor, seqs)  # the adapters moved: the policy is no longer the base
    trained, _ = actor.handle("get_logprob", seqs, {})
    shared, _ = ref.handle("get_logprob", seqs, {})
    alone = make_role(Reference, "ref", {"model": "tiny"})  # a separately loaded base model
    assert ref.model is not alone.model
    base, _ = alone.handle("get_logprob", seqs, {})
    torch.testing.assert_close(shared["ref_logprobs"], base["ref_logprobs"], atol=1e-6, rtol=0)
    assert not torch.allclose(trained["old_logprobs"], base["ref_logprobs"], atol=1e-3)
    after, _ = actor.handle("get_logprob", seqs, {})  # the adapters are back on
    assert torch.equal(after["old_logprobs"], trained["old_logprobs"])


def test_share_base_off_or_impossible_loads_the_references_own_model():
    actor, ref = _colocated(LORA, {"model": "tiny", "share_base": False})
    assert ref.model is not actor.model
    actor, ref = _colocated({"model": "tiny"})  # full fine-tuning: nothing to share
    assert ref.model is not actor.model
    with pytest.raises(ConfigError, match="share_base") as err:
        _colocated({"model": "tiny"}, {"model": "tiny", "share_base": True})
    assert "no LoRA adapters" in str(err.value)
    with pytest.raises(ConfigError, match="differ in dtype"):
        _colocated(LORA, {"model": "tiny", "dtype": "bfloat16", "share_base": True})


def _pushed_actor(steps=6):
    """A LoRA actor trained towards one fixed response (positive advantage on every token):
    its greedy tokens then differ from the base model's."""
    actor = make_role(Actor, "actor", {**LORA, "lr": 5e-2})
    batch = prompt_batch()
    batch["response_ids"] = torch.tensor([[7, 9, 11, 13, 15, 17]] * 3)
    batch["response_mask"] = torch.ones(3, 6, dtype=torch.int64)
    _train(actor, {**batch, "advantages": torch.ones(3, 6)}, steps)
    return actor


def test_reshard_sends_merged_weights_and_the_rollout_decodes_as_the_peft_model():
    actor = _pushed_actor()
    names = [n for n, _ in actor.named_weights()]
    base_names = [n for n, _ in load_model(ModelOptions(model="tiny"), TOK).named_parameters()]
    assert names == base_names  # the engines' receive paths see the base model's names
    rollout = make_role(
        HFRollout, "rollout", {"model": "tiny", "max_new_tokens": 6, "temperature": 0.0}
    )
    rollout.update_weights(actor.named_weights(), version=1)
    batch = prompt_batch()
    out, _ = rollout.handle("generate", batch, {"step": 0, "mb_id": 0})
    with torch.no_grad():
        ref = actor.adapters.peft_model.generate(
            input_ids=batch["prompt_ids"],
            attention_mask=batch["prompt_mask"],
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=TOK.pad_token_id,
            eos_token_id=None,
        )[:, batch["prompt_ids"].shape[1] :]
    got = out["response_ids"]
    mask = out["response_mask"].bool()
    assert torch.equal(got[mask], ref[:, : got.shape[1]][mask])
    # ... and they are not the base model's tokens (the adapters changed the policy).
    base = make_role(
        HFRollout, "rollout", {"model": "tiny", "max_new_tokens": 6, "temperature": 0.0}
    )
    plain, _ = base.handle("generate", batch, {"step": 0, "mb_id": 0})
    assert not torch.equal(plain["response_ids"], got)


TOK = builtin_tokenizer()


def test_checkpoints_hold_adapters_only_and_resume_bit_exactly(tmp_path, seqs):
    a = make_role(Actor, "actor", LORA)
    _train(a, seqs)
    extra = a.save_shards(tmp_path / "shards")
    state = a.state_dict()
    (tmp_path / "extra.json").write_text(json.dumps(extra))
    from safetensors import safe_open

    (blob,) = (tmp_path / "shards").glob("*.safetensors")
    with safe_open(str(blob), "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in k for k in keys), keys[:4]
    _train(a, seqs, steps=1)
    b = make_role(Actor, "actor", LORA)
    b.load_shards(tmp_path / "shards", json.loads((tmp_path / "extra.json").read_text()))
    b.load_state_dict(state)
    _train(b, seqs, steps=1)
    sa, sb = _state(a), _state(b)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_resuming_across_lora_and_full_fine_tuning_names_the_mismatch(tmp_path, seqs):
    lora = make_role(Actor, "actor", LORA)
    _train(lora, seqs, steps=1)
    lora_extra = lora.save_shards(tmp_path / "lora")
    full = make_role(Actor, "actor", {"model": "tiny", "lr": 1e-2})
    _train(full, seqs, steps=1)
    full_extra = full.save_shards(tmp_path / "full")
    with pytest.raises(ConfigError, match=r"LoRA adapters \(lora_rank 4.*all weights"):
        make_role(Actor, "actor", {"model": "tiny"}).load_shards(tmp_path / "lora", lora_extra)
    with pytest.raises(ConfigError, match=r"all weights \(no LoRA\).*LoRA adapters"):
        make_role(Actor, "actor", LORA).load_shards(tmp_path / "full", full_extra)
    with pytest.raises(ConfigError, match="lora_rank 8"):
        make_role(Actor, "actor", {**LORA, "lora_rank": 8}).load_shards(
            tmp_path / "lora", lora_extra
        )


# peft reads a property transformers 5 deprecates (theirs; models/lora.py filters it too).
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_the_export_is_a_peft_adapter_directory_with_the_trained_log_probs(tmp_path, seqs):
    actor = make_role(Actor, "actor", {**LORA, "lora_export_merged": True})
    _train(actor, seqs)
    trained, _ = actor.handle("get_logprob", seqs, {})
    actor.export_pretrained(tmp_path / "policy", write=True)
    base = load_model(ModelOptions(model="tiny"), TOK)  # the same base: preset + run seed
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "policy")).eval()
    with torch.no_grad():
        lp, _ = response_logprobs(loaded, seqs, torch.device("cpu"))
    torch.testing.assert_close(lp, trained["old_logprobs"], atol=1e-6, rtol=0)
    merged = load_model(ModelOptions(model=str(tmp_path / "policy" / "merged")), TOK)
    with torch.no_grad():
        lp, _ = response_logprobs(merged, seqs, torch.device("cpu"))
    torch.testing.assert_close(lp, trained["old_logprobs"], atol=1e-5, rtol=0)


# Two FSDP ranks training the adapters as one process does: test_stages_fsdp.py
# (test_two_fsdp_ranks_train_the_adapters_as_one_process_does), which spawns its ranks
# once for all of its jobs.


def test_the_lora_reshard_bench_reports_merged_and_adapter_bytes(capsys):
    import importlib.util

    path = Path(__file__).parents[2] / "bench" / "lora_reshard.py"
    spec = importlib.util.spec_from_file_location("lora_reshard", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--presets", "tiny", "--ranks", "8", "--reps", "1"]) == 0
    full, lora, adapters = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert adapters["sync"] == "adapters" and adapters["sent_bytes"] == lora["adapter_bytes"]
    assert adapters["first_bytes"] > full["sent_bytes"]  # the base and the adapters, once
    assert full["lora_rank"] == 0 and lora["lora_rank"] == 8
    assert lora["sent_bytes"] == full["sent_bytes"]  # merged: the base model's bytes
    assert 0 < lora["adapter_bytes"] < full["sent_bytes"] and full["adapter_bytes"] == 0
    assert lora["trained_params"] < full["trained_params"]

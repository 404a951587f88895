"""The DataflowBuilder form of LoRA (issue 24): `add_actor(..., lora_rank=...)` reaches the
actor only (the rollout gets the merged weights, never lora_* options), the reference
stays colocated with the actor (so it runs on the actor's base weights), and lora_* on a
role that does not train fails at plan time. No processes here."""

from __future__ import annotations

import pytest

from hybridflow import DataflowBuilder
from hybridflow.errors import ConfigError
from hybridflow.pipeline.plan.planner import build_plan

LOGIC = (
    "response = actor.generate(prompt, n=4, max_new_tokens=2)\n"
    "reward_score = reward.score(prompt, response)\n"
    "ref_logprob = ref.get_logprob(prompt, response)\n"
    "actor_logprob = actor.get_logprob(prompt, response)\n"
    "kl_div = actor_logprob - ref_logprob\n"
    "loss = grpo_loss(reward_score, kl_div)\n"
    "actor.update(loss)"
)
LORA = {"lora_rank": 64, "lora_alpha": 128.0, "lora_target_modules": ["q_proj", "v_proj"]}


def _builder(**ref_options) -> DataflowBuilder:
    df = DataflowBuilder()
    df.add_actor("tiny", device_mapping="cpu", lr=1e-4, **LORA)
    df.add_reference_model("tiny", device_mapping="cpu", **ref_options)
    df.add_reward_function("hybridflow.data.tasks:last_digit_reward")
    df.define_training_step(["prompt"], ["rewards"], LOGIC)
    return df


def test_lora_options_reach_the_actor_only():
    topo = _builder().topology()
    (stage,) = [s for s in topo.stages.values() if "actor" in s.roles]
    assert {"actor", "rollout", "reference"} <= set(stage.roles)  # colocated
    actor = stage.roles["actor"].options
    assert {k: actor[k] for k in LORA} == LORA and actor["lr"] == 1e-4
    for role in ("rollout", "reference"):
        leaked = [k for k in stage.roles[role].options if k.startswith("lora_")]
        assert not leaked, (role, leaked)
    build_plan(topo)  # every role's options check at plan time


def test_lora_on_the_reference_is_refused_at_plan_time():
    topo = _builder(lora_rank=8).topology()
    with pytest.raises(ConfigError, match="trains nothing") as err:
        build_plan(topo)
    assert "roles.reference.options.lora_rank" in str(err.value)


@pytest.mark.slow  # two RL steps over stage processes
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")  # peft's
def test_engine_export_of_a_lora_run_is_a_peft_adapter_directory(tmp_path):
    peft = pytest.importorskip("peft")
    import torch

    from hybridflow.models import ModelOptions, builtin_tokenizer, load_model

    df = _builder()
    with df.build(metrics_backend="jsonl", log_dir=tmp_path / "run") as engine:
        engine.train("last_digit", steps=2)
        out = engine.export(tmp_path / "policy")
    assert (out / "adapter_config.json").is_file() and not (out / "config.json").exists()
    base = load_model(ModelOptions(model="tiny"), builtin_tokenizer())  # preset + seed 0
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        plain = base(input_ids=ids).logits
    loaded = peft.PeftModel.from_pretrained(base, str(out))  # injects into `base`
    with torch.no_grad():
        trained = loaded(input_ids=ids).logits
        with loaded.disable_adapter():
            off = loaded(input_ids=ids).logits
    # The adapters are the trained ones (B moved off zero), and off they give the base.
    assert not torch.allclose(trained, off)
    torch.testing.assert_close(off, plain, atol=0, rtol=0)


def test_sft_of_a_lora_actor_hands_rl_the_merged_model(tmp_path):
    """SFT trains adapters and merges them (`policy/merged`); RL then loads that directory
    as every role's model and trains fresh adapters on top (before: RL failed to load the
    adapter directory as a model)."""
    pytest.importorskip("peft")
    df = _builder()
    with df.build(metrics_backend="jsonl", log_dir=tmp_path / "run") as engine:
        sft = engine.sft("last_digit", steps=2, batch_size=8)
        assert len(sft.metrics) == 2
        actor = engine.job.declared.actor_options  # the engine's job, not the builder
        assert actor["model"].endswith("/policy/merged")
        assert df.actor_options()["model"] == "tiny"  # the builder is left as declared
        assert (tmp_path / "run" / "sft").is_dir()
        assert (tmp_path.joinpath(actor["model"]) / "config.json").is_file()
        rl = engine.train("last_digit", steps=1)
    assert [r["step"] for r in rl.metrics] == [0]

"""The hf rollout with an environment (generate -> the trajectory loop), and what the
model roles compute on its multi-turn output: log-probs that are the sampler's, masks
zero on observations, reproducible seeds, batching that changes no token."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from mt_helpers import CountdownEnv, chat_tokenizer, countdown_records, prompt_batch, tokenizer_dir

from hybridflow.errors import BatchError, ConfigError
from hybridflow.stages.actor import Actor
from hybridflow.stages.base import OpIO, StageWorld
from hybridflow.stages.common import response_span
from hybridflow.stages.critic import Critic
from hybridflow.stages.env.builtin.guess_number import make_records
from hybridflow.stages.reference import Reference
from hybridflow.stages.rollout.hf import HFRollout
from hybridflow.stages.rollout.state import GENERATE_OUTPUTS, RolloutState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stages"))
from stage_helpers import make_role

TOK = chat_tokenizer()
SEQ = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return tokenizer_dir(tmp_path_factory.mktemp("tok"))


def rollout(tokdir, **options):
    opts = {"model": "tiny", "tokenizer": tokdir, "max_new_tokens": 5, **options}
    return make_role(HFRollout, "r", opts)


def guess_rollout(tokdir, **options):
    return rollout(
        tokdir,
        env="guess_number",
        env_options={"low": 1, "high": 3, "max_turns": 3},
        max_turns=3,
        **options,
    )


def guess_batch(n=4):
    return prompt_batch(TOK, make_records(n, 0, low=1, high=3, max_turns=3))


def runs(mask_row):
    """[(start, end, value)] of the maximal runs of equal values in a 0/1 row."""
    out, start = [], 0
    values = mask_row.tolist()
    for t in range(1, len(values) + 1):
        if t == len(values) or values[t] != values[start]:
            out.append((start, t, values[start]))
            start = t
    return out


def test_generate_with_an_env_returns_the_single_turn_fields_laid_out_by_turns(tokdir):
    role = guess_rollout(tokdir, n=2)
    batch = guess_batch(3)
    out, metrics = role.handle("generate", batch, {"step": 0, "mb_id": 0})
    assert set(GENERATE_OUTPUTS) <= set(out)
    b, r = out["response_ids"].shape
    assert b == 6 and out["response_mask"].shape == (b, r)
    assert (
        out["response_mask"].dtype == torch.int64 and out["rollout_logprobs"].dtype == torch.float32
    )
    assert out["env_reward"].shape == (b,) and out["env_reward"].dtype == torch.float32
    assert out["num_turns"].dtype == torch.int64
    assert out["group_index"].tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.equal(out["prompt_ids"], batch["prompt_ids"].repeat_interleave(2, 0))
    for row in range(b):
        length = int(response_span(out["response_mask"][row : row + 1]).sum())
        spans = runs(out["response_mask"][row, :length])
        model = [s for s in spans if s[2] == 1]
        assert len(model) == int(out["num_turns"][row]) and spans[-1][2] == 1
        for start, end, value in spans:
            text = TOK.decode(out["response_ids"][row, start:end])
            lp = out["rollout_logprobs"][row, start:end]
            if value:
                assert bool((lp < 0).all())
            else:  # an observation: the env's feedback, templated; log-prob 0
                assert bool((lp == 0).all())
                assert text.lstrip("<eos>").startswith("\nuser:\n") and text.endswith(
                    "assistant:\n"
                )
                assert "left." in text
        assert bool((out["response_ids"][row, length:] == TOK.pad_token_id).all())
    assert metrics["rollout/turns/mean"] == pytest.approx(out["num_turns"].float().mean().item())
    assert metrics["rollout/tokens"] == float(out["response_mask"].sum())
    obs = int((response_span(out["response_mask"]) - out["response_mask"]).sum())
    assert metrics["rollout/obs_token_frac"] == pytest.approx(
        obs / int(response_span(out["response_mask"]).sum())
    )
    for key in ("rollout/tool_calls", "rollout/tool_errors", "env/step_s", "env/invalid_guess"):
        assert key in metrics


def test_a_seeded_multi_turn_generate_repeats_exactly(tokdir):
    batch = guess_batch(4)
    a, _ = guess_rollout(tokdir).handle("generate", batch, {"step": 3, "mb_id": 1})
    b, _ = guess_rollout(tokdir).handle("generate", batch, {"step": 3, "mb_id": 1})
    c, _ = guess_rollout(tokdir).handle("generate", batch, {"step": 3, "mb_id": 2})
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert not torch.equal(a["response_ids"], c["response_ids"])


def test_trajectories_of_different_lengths_batched_equal_one_at_a_time_at_temperature_0(tokdir):
    """Continuous-batching equality: a turn's batch mixes contexts of different lengths
    (left-padded) and loses members as trajectories end; no token may change."""
    opts = dict(env="mt_helpers:CountdownEnv", max_turns=5, temperature=0.0, max_new_tokens=4)
    records = countdown_records([1, 4, 2, 3])
    together, _ = rollout(tokdir, **opts).handle("generate", prompt_batch(TOK, records), {})
    assert together["num_turns"].tolist() == [1, 4, 2, 3]
    alone = rollout(tokdir, **opts)
    for row, rec in enumerate(records):
        one, _ = alone.handle("generate", prompt_batch(TOK, [rec]), {})
        k = one["response_ids"].shape[1]
        assert torch.equal(together["response_ids"][row, :k], one["response_ids"][0]), row
        assert torch.equal(together["response_mask"][row, :k], one["response_mask"][0])
        assert not together["response_mask"][row, k:].any()
        assert torch.allclose(
            together["rollout_logprobs"][row, :k], one["rollout_logprobs"][0], atol=1e-4
        )


def test_actor_reference_and_critic_read_observations_as_context(tokdir):
    """Interior masked spans: every model token's log-prob recomputed by the actor and
    the reference is the sampler's (they attend to the observations, as it did)."""
    out, _ = guess_rollout(tokdir, n=2).handle("generate", guess_batch(3), {"step": 0, "mb_id": 0})
    mask = out["response_mask"].bool()
    assert bool((response_span(out["response_mask"]).bool() & ~mask).any())  # interior zeros
    seq = {k: out[k] for k in SEQ}
    actor = make_role(Actor, "a", {"model": "tiny", "tokenizer": tokdir})
    lp, _ = actor.handle("get_logprob", seq, {})
    assert float((lp["old_logprobs"] - out["rollout_logprobs"])[mask].abs().max()) < 1e-4
    assert bool((lp["old_logprobs"][~mask] == 0).all())
    ref = make_role(Reference, "ref", {"model": "tiny", "tokenizer": tokdir})
    rl, _ = ref.handle("get_logprob", seq, {})
    assert float((rl["ref_logprobs"] - out["rollout_logprobs"])[mask].abs().max()) < 1e-4
    # The forward before the fix, response_mask as the attention mask, gives other
    # log-probs once an observation came: the check above would see it.
    ids = torch.cat([seq["prompt_ids"], seq["response_ids"]], 1)
    old_mask = torch.cat([seq["prompt_mask"], seq["response_mask"]], 1)
    with torch.no_grad():
        logits = (
            actor.model(
                input_ids=ids,
                attention_mask=old_mask,
                position_ids=(old_mask.cumsum(-1) - 1).clamp(min=0),
            )
            .logits[:, -(mask.shape[1] + 1) : -1]
            .float()
        )
    old = torch.log_softmax(logits, -1).gather(-1, seq["response_ids"][..., None]).squeeze(-1)
    assert float((old - out["rollout_logprobs"])[mask].abs().max()) > 1e-2
    critic = make_role(Critic, "c", {"model": "tiny", "tokenizer": tokdir})
    values, _ = critic.handle("values", seq, {})
    full = dict(seq, response_mask=response_span(seq["response_mask"]))  # all real tokens
    values_full, _ = critic.handle("values", full, {})
    v, vf = values["values"], values_full["values"]
    assert float((v - vf)[mask].abs().max()) < 1e-5 and bool((v[~mask] == 0).all())


def test_actor_update_trains_on_model_tokens_only(tokdir):
    out, _ = guess_rollout(tokdir, n=2).handle("generate", guess_batch(2), {"step": 0, "mb_id": 0})
    seq = {k: out[k] for k in SEQ}
    actor = make_role(Actor, "a", {"model": "tiny", "tokenizer": tokdir, "lr": 1e-2})
    adv = torch.where(out["response_mask"].bool(), 1.0, 0.0)
    # advantages on observation tokens must not matter: garbage there, same gradient
    noisy = adv + (1 - out["response_mask"]) * 1e3
    grads = []
    for a in (adv, noisy):
        actor.model.zero_grad(set_to_none=True)
        actor.handle(
            "update",
            {**seq, "advantages": a, "rollout_logprobs": out["rollout_logprobs"]},
            {},
        )
        grads.append(
            torch.cat([p.grad.flatten() for p in actor.model.parameters() if p.grad is not None])
        )
    assert torch.allclose(grads[0], grads[1])


def test_multi_turn_needs_the_records_and_single_turn_refuses_env_outputs(tokdir):
    world = StageWorld(dataflow={"generate": OpIO(inputs=("prompt_ids", "prompt_mask"))})
    with pytest.raises(ConfigError, match=r"options.env: .*add metadata_json"):
        make_role(
            HFRollout,
            "r",
            {"model": "tiny", "tokenizer": tokdir, "env": "guess_number"},
            world=world,
        )
    world = StageWorld(dataflow={"generate": OpIO(outputs=("response_ids", "env_reward"))})
    with pytest.raises(ConfigError, match=r"asks generate for \['env_reward'\]"):
        make_role(HFRollout, "r", {"model": "tiny", "tokenizer": tokdir}, world=world)
    role = guess_rollout(tokdir)
    batch = guess_batch(2)
    del batch["metadata_json"]
    with pytest.raises(BatchError, match="needs metadata_json"):
        role.handle("generate", batch, {})


def test_a_backend_without_the_loop_refuses_env():
    class Plain(RolloutState):
        backend_name = "plain"

    p = Plain()
    p.opts = type("O", (), {"env": "guess_number"})()
    with pytest.raises(BatchError, match="plain rollout: env 'guess_number' is set"):
        p._call_options({})


def test_single_turn_generate_is_unchanged_by_the_env_options(tokdir):
    """env "" keeps the single-turn path: no env outputs, the same samples as before."""
    batch = guess_batch(2)
    out, metrics = rollout(tokdir, max_turns=3, env_timeout_s=1.0).handle(
        "generate", batch, {"step": 0, "mb_id": 0}
    )
    base, _ = rollout(tokdir).handle("generate", batch, {"step": 0, "mb_id": 0})
    assert "env_reward" not in out and "rollout/turns/mean" not in metrics
    for key in base:
        assert torch.equal(out[key], base[key])
    CountdownEnv.reset_counters()

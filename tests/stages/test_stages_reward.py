"""Reward backends: Python functions (by name) and a sequence-classification model."""

from __future__ import annotations

import pytest
import torch
from stage_helpers import TOK, make_role, prompt_batch

from hybridflow.data import TASKS, encode_metadata, pad_right
from hybridflow.errors import ConfigError, RewardFunctionError
from hybridflow.stages.reward.function import FunctionReward
from hybridflow.stages.reward.model import ModelReward

PROMPTS = ["last:40719=", "last:123=", "last:5="]


def _scored_batch(responses, metadata):
    ids, mask = pad_right(
        [TOK(r, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id] for r in responses],
        TOK.pad_token_id,
    )
    return {
        **prompt_batch(PROMPTS),
        "response_ids": ids,
        "response_mask": mask,
        "metadata_json": encode_metadata(metadata),
    }


def _fn_role(name):
    return make_role(FunctionReward, "reward", {"function": name, "tokenizer": "builtin"})


def test_builtin_task_reward_through_the_role():
    role = _fn_role(TASKS["last_digit"].reward_function)
    metadata = [{"answer": "9", "id": "a"}, {"answer": "3", "id": "b"}, {"id": "c"}]
    out, metrics = role.handle("score", _scored_batch(["9", " 7", "5 5"], metadata), {})
    assert out["rewards"].dtype == torch.float32
    assert out["rewards"].tolist() == pytest.approx([1.0, 0.5, 0.8])  # c: answer from prompt
    assert metrics["reward/fn_s"] >= 0


def test_batch_tensors_reach_the_function_as_metadata():
    role = _fn_role("fn_rewards_for_stages:echo_group")
    batch = _scored_batch(["1", "22", "333"], [{}, {}, {}])
    batch["group_index"] = torch.tensor([4, 4, 5])
    out, _ = role.handle("score", batch, {})
    # response_ids arrive unpadded (EOS included): len = text tokens + 1
    assert out["rewards"].tolist() == pytest.approx([4.02, 4.03, 5.04])


def test_a_raising_function_names_the_function_and_the_sample():
    role = _fn_role("fn_rewards_for_stages:fails_on_bad")
    batch = _scored_batch(["1", "2", "3"], [{"id": "ok"}, {"id": "bad"}, {"id": "ok2"}])
    with pytest.raises(
        RewardFunctionError, match=r"fails_on_bad raised on sample 1 \(id bad\): ZeroDivisionError"
    ) as exc:
        role.handle("score", batch, {})
    assert exc.value.sample == 1 and exc.value.function.endswith(":fails_on_bad")
    role = _fn_role("fn_rewards_for_stages:fails_on_batches")
    with pytest.raises(RewardFunctionError, match="each sample alone succeeds"):
        role.handle("score", batch, {})


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("returns_nan", r"returned nan for sample 2 \(id 2\)"),
        ("returns_short", "returned 2 values for 3 samples"),
        ("returns_text", "returned '1.0' for sample 0"),
    ],
)
def test_bad_results_are_errors_never_zeros(name, message):
    role = _fn_role(f"fn_rewards_for_stages:{name}")
    batch = _scored_batch(["1", "2", "3"], [{"index": 0}, {"index": 1}, {"index": 2}])
    with pytest.raises(RewardFunctionError, match=message):
        role.handle("score", batch, {})


def test_function_option_errors():
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        _fn_role("no_such_module:f")
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        _fn_role("fn_rewards_for_stages:nope")
    with pytest.raises(ConfigError, match="not callable"):
        _fn_role("fn_rewards_for_stages:NOT_CALLABLE")
    with pytest.raises(ConfigError, match=r"package\.module:function"):
        _fn_role("fn_rewards_for_stages.echo_group")
    with pytest.raises(ConfigError, match=r"stages\.reward\.options\.tokenizer"):
        make_role(FunctionReward, "reward", {"function": "fn_rewards_for_stages:echo_group"})


def test_reward_model_scores_the_last_real_token():
    role = make_role(ModelReward, "reward", {"model": "tiny"})
    batch = _scored_batch(["9", "77", "5"], [{}, {}, {}])
    out, _ = role.handle("score", batch, {})
    r = out["rewards"]
    assert r.shape == (3,) and r.dtype == torch.float32 and bool(torch.isfinite(r).all())
    # Same sequence alone, without padding: same score (padding changes nothing).
    for i in range(3):
        real = torch.cat(
            [
                batch["prompt_ids"][i][batch["prompt_mask"][i].bool()],
                batch["response_ids"][i][batch["response_mask"][i].bool()],
            ]
        )
        with torch.no_grad():
            hidden = role.model.base_model(input_ids=real[None]).last_hidden_state
            alone = role.model.score(hidden[:, -1])[0, 0]
        assert float(alone) == pytest.approx(float(r[i]), abs=1e-5)
    assert len(set(r.tolist())) == 3

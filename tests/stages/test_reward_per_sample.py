"""The function backend with verl's per-sample signature (compute_score), and the one
value check every batched result passes (hybridflow/reward/values.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from stage_helpers import TOK, make_role, prompt_batch

from hybridflow.data import decode_metadata, encode_metadata, pad_right
from hybridflow.errors import ConfigError, RewardFunctionError
from hybridflow.stages.reward.function import FunctionReward
from hybridflow.stages.reward.per_sample import is_per_sample

PROMPTS = ["last:40719=", "last:123=", "last:5="]
FNS = "fn_rewards_for_stages"


def _record(gt, **extra):
    return {
        "data_source": "openai/gsm8k",
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"split": "test", **extra},
        "index": extra.get("index", 0),
    }


def _batch(responses, metadata):
    ids, mask = pad_right(
        [TOK(r, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id] for r in responses],
        TOK.pad_token_id,
    )
    return {
        **prompt_batch(PROMPTS[: len(responses)]),
        "response_ids": ids,
        "response_mask": mask,
        "metadata_json": encode_metadata(metadata),
    }


def _role(fn, **options):
    return make_role(
        FunctionReward, "reward", {"function": f"{FNS}:{fn}", "tokenizer": "builtin", **options}
    )


def test_the_signature_decides_the_calling_style():
    import fn_rewards_for_stages as m

    assert is_per_sample(m.verl_exact) and is_per_sample(m.verl_async)
    assert not is_per_sample(m.echo_group)


def test_a_verl_function_gets_ground_truth_and_its_dict_becomes_reward_metrics_and_info():
    role = _role("verl_exact")
    meta = [_record("9", index=0), _record("3", index=1), _record("5", index=2)]
    out, metrics = role.handle("score", _batch(["9", "7", "5"], meta), {})
    assert out["rewards"].tolist() == [1.0, 0.0, 1.0]
    assert metrics["reward/acc"] == pytest.approx(2 / 3)
    assert metrics["reward/len"] == pytest.approx(1.0)
    assert "reward/pred" not in metrics and "reward/src" not in metrics  # strings: info only
    info = decode_metadata(out["reward_info"])
    assert [i["pred"] for i in info] == ["9", "7", "5"]
    assert info[0]["src"] == "openai/gsm8k" and info[1]["acc"] == 0.0
    assert metrics["reward/fn_failures"] == 0


def test_extra_info_is_passed_only_to_functions_that_take_it():
    meta = [_record("9", weight=0.75), _record("1", weight=0.5)]
    out, _ = _role("verl_sees_extra_info").handle("score", _batch(["1", "2"], meta), {})
    assert out["rewards"].tolist() == [0.75, 0.5]
    out, _ = _role("verl_float_no_extra_info").handle("score", _batch(["1", "2"], meta), {})
    assert out["rewards"].tolist() == [0.5, 0.25]


def test_a_custom_ground_truth_key():
    meta = [{"answer": {"final": "9"}}, {"answer": {"final": "2"}}]
    role = _role("verl_exact", ground_truth_key="answer.final")
    out, _ = role.handle("score", _batch(["9", "3"], meta), {})
    assert out["rewards"].tolist() == [1.0, 0.0]


def test_a_record_without_the_ground_truth_names_the_row_and_the_key():
    meta = [_record("9", index=0), {"data_source": "x", "index": 41, "id": "q41"}]
    with pytest.raises(
        RewardFunctionError, match=r"row 41 \(id q41\) has no 'reward_model.ground_truth'"
    ):
        _role("verl_exact").handle("score", _batch(["9", "3"], meta), {})


def test_async_functions_are_awaited_concurrently():
    role = _role("verl_async")
    meta = [_record("9"), _record("3"), _record("5")]
    out, _ = role.handle("score", _batch(["9", "3", "4"], meta), {})
    assert out["rewards"].tolist() == [1.0, 1.0, 0.0]


def test_one_raising_sample_is_named_and_the_others_keep_their_rewards(caplog):
    meta = [_record("1", index=0), _record("1", index=1), _record("1", index=2)]
    with caplog.at_level(logging.WARNING, logger="hybridflow.reward.function"):
        out, metrics = _role("verl_raises_on_7").handle("score", _batch(["1", "7", "2"], meta), {})
    assert out["rewards"].tolist() == [1.0, 0.0, 1.0]
    assert metrics["reward/fn_failures"] == 1
    assert "verl_raises_on_7 failed on sample 1 (id 1): ValueError: cannot parse 7" in caplog.text


def test_a_hanging_sample_times_out_without_stalling_the_batch():
    meta = [_record("1"), _record("1"), _record("1")]
    role = _role("verl_hangs_on_7", timeout_s=0.3, failure_score=-1.0)
    out, metrics = role.handle("score", _batch(["1", "7", "2"], meta), {})
    # The 30 s call was abandoned at its deadline (it runs on in a daemon thread).
    assert out["rewards"].tolist() == [1.0, -1.0, 1.0]
    assert metrics["reward/fn_timeout_count"] == 1 and metrics["reward/fn_failures"] == 1


def test_a_non_finite_value_is_a_named_failure():
    meta = [_record("1"), _record("1")]
    with pytest.raises(RewardFunctionError, match=r"sample 1 .*rewards must be finite"):
        _role("verl_returns_inf", failure_score=None).handle("score", _batch(["1", "7"], meta), {})
    out, metrics = _role("verl_returns_inf").handle("score", _batch(["1", "7"], meta), {})
    assert out["rewards"].tolist() == [1.0, 0.0] and metrics["reward/fn_failures"] == 1


def test_a_function_failing_on_every_sample_ends_the_run():
    meta = [_record("1"), _record("1")]
    with pytest.raises(RewardFunctionError, match=r"RuntimeError: broken \(all 2 samples failed\)"):
        _role("verl_always_raises").handle("score", _batch(["1", "2"], meta), {})


def test_style_can_be_forced():
    meta = [_record("9"), _record("3")]
    with pytest.raises(RewardFunctionError):  # called batched: wrong arguments
        _role("verl_exact", style="batched").handle("score", _batch(["9", "3"], meta), {})


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("returns_dict", r"returned a dict with keys \['score'\], expected a list of 3 numbers"),
        ("returns_huge", r"returned 1e\+39 for sample 1 \(id 1\); beyond float32's range"),
        ("returns_overflow", r"returned 1000.* for sample 0 \(id 0\); does not fit a float32"),
    ],
)
def test_batched_values_are_checked_in_float32(name, message):
    role = make_role(
        FunctionReward, "reward", {"function": f"{FNS}:{name}", "tokenizer": "builtin"}
    )
    batch = _batch(["1", "2", "3"], [{"index": 0}, {"index": 1}, {"index": 2}])
    with pytest.raises(RewardFunctionError, match=message):
        role.handle("score", batch, {})


def test_the_batched_style_still_returns_empty_info():
    role = make_role(
        FunctionReward, "reward", {"function": f"{FNS}:echo_group", "tokenizer": "builtin"}
    )
    batch = _batch(["1", "2"], [{}, {}])
    batch["group_index"] = torch.tensor([1, 2])
    out, _ = role.handle("score", batch, {})
    assert decode_metadata(out["reward_info"]) == [{}, {}]


def test_option_errors():
    with pytest.raises(ConfigError, match="exactly one of `function`"):
        make_role(FunctionReward, "reward", {"tokenizer": "builtin"})
    with pytest.raises(ConfigError, match=r"options\.timeout_s"):
        _role("verl_exact", timeout_s=0)
    with pytest.raises(ConfigError, match=r"options\.failure_score"):
        _role("verl_exact", failure_score=float("nan"))
    with pytest.raises(ConfigError, match=r"options\.ground_truth_key"):
        _role("verl_exact", ground_truth_key="a..b")


def test_a_builtin_scorer_by_name_and_an_unknown_one():
    role = make_role(FunctionReward, "reward", {"scorer": "gsm8k", "tokenizer": "builtin"})
    meta = [_record("42"), _record("42")]
    out, metrics = role.handle("score", _batch(["so #### 42", "#### 41"], meta), {})
    assert out["rewards"].tolist() == [1.0, 0.0] and metrics["reward/acc"] == 0.5
    assert [i["pred"] for i in decode_metadata(out["reward_info"])] == ["42", "41"]
    with pytest.raises(
        ConfigError, match=r"options\.scorer: unknown scorer 'gsmk8'.*did you mean 'gsm8k'"
    ):
        make_role(FunctionReward, "reward", {"scorer": "gsmk8", "tokenizer": "builtin"})

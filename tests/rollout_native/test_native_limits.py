"""The native backend's limits (stages/rollout/native/limits.py): the default
`max_prompt_len` adapts to the model, and what the engine could not run is a ConfigError
at plan time (`hybridflow validate`), naming the option, not a failure at stage setup.

Before: the default max_prompt_len was 512, so the `tiny` preset (512 positions) failed
at setup with every max_new_tokens, and validate said "ok".
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from native_helpers import ctx

from hybridflow.config.loader import from_dict
from hybridflow.config.schema import load_topology
from hybridflow.errors import ConfigError
from hybridflow.models.loader import load_model, load_tokenizer
from hybridflow.pipeline.plan.planner import build_plan
from hybridflow.stages.rollout.native import limits
from hybridflow.stages.rollout.native.role import NativeRollout, NativeRolloutOptions

KEY = "stages.engine.roles.rollout.options"


def options(**kw: Any) -> NativeRolloutOptions:
    return from_dict(NativeRolloutOptions, {"model": "tiny", "tokenizer": "builtin", **kw}, "o")


def plan(**rollout: Any) -> None:
    """build_plan (what validate runs) of the grpo preset with a native rollout."""
    sets = ["stages.engine.roles.rollout.backend=native"]
    sets += [f"{KEY}.{k}={json.dumps(v)}" for k, v in rollout.items()]
    build_plan(load_topology("grpo", sets))


def test_the_default_fits_a_512_position_model_and_setup_runs_it():
    r = NativeRollout()
    r.setup(ctx({"max_new_tokens": 12, "kv_cache_gb": 0.01}))  # tiny: 512 positions
    try:
        assert r.max_prompt_len == 500
        assert r.engine is not None
    finally:
        r.close()


@pytest.mark.parametrize(
    ("overrides", "max_new_tokens", "want"),
    [
        ({}, 12, 500),  # room 500 < 512
        ({}, 8, 504),
        ({"max_position_embeddings": 4096}, 64, 512),  # a long model: the default cap
        ({"max_position_embeddings": 64}, 16, 48),
    ],
)
def test_the_default_max_prompt_len_is_min_512_and_the_room_left(overrides, max_new_tokens, want):
    opts = options(model_overrides=overrides, max_new_tokens=max_new_tokens)
    assert limits.check(opts, limits.model_facts(opts, "o"), "o") == want


def test_a_set_max_prompt_len_is_kept_when_it_fits():
    opts = options(max_prompt_len=100, max_new_tokens=12)
    assert limits.check(opts, limits.model_facts(opts, "o"), "o") == 100


def test_validate_accepts_the_native_default_on_the_tiny_preset():
    plan()


@pytest.mark.parametrize(
    ("rollout", "key", "message"),
    [
        (
            {"max_prompt_len": 512},
            "max_prompt_len",
            "512 + max_new_tokens 2 exceeds the model's 512",
        ),
        ({"max_new_tokens": 600}, "max_new_tokens", "600 new tokens leave no room for a prompt"),
        ({"kv_cache_gb": 1e-6}, "kv_cache_gb", "holds no sequence: one slot of 512 positions"),
        (
            {"model_overrides": {"max_position_embeddings": 8}, "max_new_tokens": 8},
            "max_new_tokens",
            "8 positions",
        ),
        ({"max_prompt_len": 0}, "max_prompt_len", "must be >= 1 (or unset)"),
    ],
)
def test_validate_names_the_native_option_the_engine_could_not_run(rollout, key, message):
    with pytest.raises(ConfigError) as info:
        plan(**rollout)
    assert info.value.path == f"{KEY}.{key}", str(info.value)
    assert message in str(info.value)


def test_validate_refuses_an_architecture_from_a_model_directorys_config(tmp_path):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError) as info:
        plan(model=str(tmp_path / "gpt2"), tokenizer="builtin")
    assert info.value.path == f"{KEY}.model" and "'gpt2'" in str(info.value)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window attention"),
        ({"use_sliding_window": True}, "sliding-window attention"),
    ],
)
def test_sliding_window_layers_are_refused_from_the_config(cfg, message):
    facts = limits.ModelFacts.of({"model_type": "qwen2", "max_position_embeddings": 512, **cfg})
    with pytest.raises(ConfigError, match=message) as info:
        limits.check(options(), facts, "o")
    assert info.value.path == "o.model"


def test_a_mistral_window_bounds_the_slot_in_whole_slots():
    facts = limits.ModelFacts.of(
        {"model_type": "mistral", "max_position_embeddings": 4096, "sliding_window": 100}
    )
    assert limits.check(options(max_new_tokens=20), facts, "o") == 96 - 20  # 100 -> 96
    with pytest.raises(ConfigError, match="sliding window of 100 positions") as info:
        limits.check(options(max_prompt_len=80, max_new_tokens=20), facts, "o")
    assert info.value.path == "o.max_prompt_len"


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3", "tiny-llama", "tiny-mistral", "small"])
def test_plan_time_facts_equal_the_built_models(preset):
    """The invariant that makes the plan's check worth having: what it reads from a
    preset is what setup reads from the built model's config."""
    opts = options(model=preset)
    model = load_model(opts, load_tokenizer("builtin"), seed=0)
    assert limits.model_facts(opts, "o") == limits.ModelFacts.of(model.config)

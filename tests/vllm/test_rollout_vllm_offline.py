"""What must hold without vLLM installed: the backend imports, validates its options, and
fails at setup with an error that says how to get vLLM."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridflow.errors import ConfigError
from hybridflow.stages import vllm_compat
from hybridflow.stages.base import StageContext
from hybridflow.stages.rollout_vllm import VLLMRollout, VLLMRolloutConfig


def ctx(tmp_path, **options) -> StageContext:
    return StageContext(
        stage="rollout",
        replica=0,
        device=torch.device("cpu"),
        seed=0,
        run_dir=tmp_path,
        options=options,
        log=logging.getLogger("test.vllm"),
    )


def test_options_are_validated_with_dotted_paths(tmp_path):
    (tmp_path / "config.json").write_text('{"eos_token_id": 2}')
    from hybridflow.config.loader import from_dict

    cfg = from_dict(VLLMRolloutConfig, {"model": str(tmp_path), "n": 4}, "stages.rollout.options")
    assert cfg.n == 4 and cfg.temperature == 1.0
    with pytest.raises(ConfigError, match=r"stages\.rollout\.options\.top_p"):
        VLLMRollout().setup(ctx(tmp_path, model=str(tmp_path), top_p=1.5))
    with pytest.raises(ConfigError, match=r"stages\.rollout\.options\.temprature.*temperature"):
        VLLMRollout().setup(ctx(tmp_path, model=str(tmp_path), temprature=1.0))
    with pytest.raises(ConfigError, match=r"options\.model"):
        VLLMRollout().setup(ctx(tmp_path, model=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match=r"options\.n"):
        VLLMRollout().setup(ctx(tmp_path, model=str(tmp_path), temperature=0.0, n=2))


def test_setup_without_vllm_names_the_fix(tmp_path):
    if vllm_compat.vllm_available():
        pytest.skip("vLLM is installed here")
    (tmp_path / "config.json").write_text('{"eos_token_id": 2}')
    with pytest.raises(vllm_compat.VLLMUnavailableError, match=r"install_vllm_cpu\.sh"):
        VLLMRollout().setup(ctx(tmp_path, model=str(tmp_path)))


def test_version_gate():
    vllm_compat.check_version("0.32.0")
    vllm_compat.check_version("0.32.1+cpu")
    with pytest.raises(vllm_compat.VLLMUnavailableError, match="outside the range"):
        vllm_compat.check_version("0.10.2")

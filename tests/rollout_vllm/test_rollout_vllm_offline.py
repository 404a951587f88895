"""What must hold without vLLM installed: the backend imports, validates its options, and
fails at setup with an error that says how to get vLLM."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridflow.config.loader import from_dict
from hybridflow.errors import BatchError, ConfigError
from hybridflow.stages.base import StageContext
from hybridflow.stages.rollout import vllm_compat
from hybridflow.stages.rollout.vllm import VLLMRollout, VLLMRolloutOptions, _VLLMWeights


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


def options(**values) -> VLLMRolloutOptions:
    return from_dict(VLLMRolloutOptions, values, "stages.rollout.options")


def test_options_are_the_hf_backends_plus_engine_settings():
    opts = options(model="tiny-vllm", n=4, top_k=5, kv_cache_bytes=1 << 20, sleep_level=2)
    assert (opts.n, opts.top_k, opts.temperature, opts.dtype) == (4, 5, 1.0, "float32")
    with pytest.raises(ConfigError, match=r"stages\.rollout\.options\.top_p"):
        options(model="tiny-vllm", top_p=1.5)
    with pytest.raises(ConfigError, match=r"options\.temprature.*temperature"):
        options(model="tiny-vllm", temprature=1.0)
    with pytest.raises(ConfigError, match=r"options\.n\b"):
        options(model="tiny-vllm", temperature=0.0, n=2)
    with pytest.raises(ConfigError, match=r"options\.sleep_level"):
        options(model="tiny-vllm", sleep_level=3)
    with pytest.raises(ConfigError, match=r"options\.model"):
        options()


def test_setup_without_vllm_names_the_fix(tmp_path):
    if vllm_compat.vllm_available():
        pytest.skip("vLLM is installed here")
    with pytest.raises(vllm_compat.VLLMUnavailableError, match=r"install_vllm_cpu\.sh"):
        VLLMRollout().setup(ctx(tmp_path, model="tiny-vllm"))


def test_version_gate(monkeypatch):
    monkeypatch.delenv("HYBRIDFLOW_VLLM_ANY_VERSION", raising=False)
    vllm_compat.check_version("0.31.0")
    vllm_compat.check_version("0.32.0")
    vllm_compat.check_version("0.32.1+cpu")
    with pytest.raises(vllm_compat.VLLMUnavailableError, match="outside the range"):
        vllm_compat.check_version("0.28.0")
    with pytest.raises(vllm_compat.VLLMUnavailableError, match="outside the range"):
        vllm_compat.check_version("0.33.0")
    monkeypatch.setenv("HYBRIDFLOW_VLLM_ANY_VERSION", "1")
    vllm_compat.check_version("0.28.0")


def test_sleep_wake_bookkeeping_with_a_fake_engine_seam(monkeypatch):
    """GPU-only path, run here with vllm_compat.sleep/wake_up faked (the seam to vLLM):
    what sleep() released is restored tag by tag, and generate waits for all of it."""
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(vllm_compat, "sleep", lambda llm, level: calls.append(("sleep", level)))
    monkeypatch.setattr(vllm_compat, "wake_up", lambda llm, tags: calls.append(("wake", tags)))
    role = VLLMRollout()
    role.opts, role.on_gpu, role.llm = options(model="tiny-vllm", sleep_level=2), True, object()
    role.weights = _VLLMWeights(role)
    role._ready = True  # set up by hand through the seam, not by setup()

    assert role.handle("sleep", {}, {})[1] == {"rollout/sleep_skipped": 0.0}
    with pytest.raises(BatchError, match="asleep"):
        role._check_ready("generate")
    assert role.wake_up(["weights"]) == {"rollout/wake_skipped": 0.0}
    with pytest.raises(BatchError, match=r"\['kv_cache'\]"):
        role._check_ready("generate")
    assert role.handle("wake_up", {}, {"tags": ["kv_cache"]})[1] == {"rollout/wake_skipped": 0.0}
    role._check_ready("generate")
    assert role.wake_up(None) == {"rollout/wake_skipped": 1.0}
    assert calls == [("sleep", 2), ("wake", ["weights"]), ("wake", ["kv_cache"])]
    # On CPU (or with sleep_mode off) both are no-ops.
    role.on_gpu = False
    assert role.handle("sleep", {}, {})[1] == {"rollout/sleep_skipped": 1.0}


def test_holding_adapters_refuses_a_sleep_that_discards_the_base():
    """GPU-only path, checked before any engine work: sleep_level 2 throws the base away
    at every sleep, and adapter-only syncs never send it again."""
    role = VLLMRollout()
    role.opts, role.on_gpu = options(model="tiny-vllm", sleep_level=2), True
    role.path = "stages.gen.roles.rollout.options"
    with pytest.raises(ConfigError, match=r"options\.sleep_level.*sleep_level: 1"):
        role.hold_adapters({"lora_rank": 4, "lora_alpha": 8.0}, 0)


def test_the_peft_adapter_directory_is_what_peft_writes(tmp_path):
    """vllm_lora writes the adapters as peft's save_pretrained does (vLLM loads that)."""
    import json

    from hybridflow.stages.rollout.vllm_lora import write_peft_adapter

    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    a, b = torch.randn(4, 8), torch.randn(6, 4)
    names = {
        "model.layers.0.self_attn.q_proj.lora_A.default.weight": a,
        "model.layers.0.self_attn.q_proj.lora_B.default.weight": b,
    }
    write_peft_adapter(tmp_path, names, {"lora_rank": 4, "lora_alpha": 8.0})
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, ["q_proj"])
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    assert torch.equal(saved[f"{prefix}.lora_A.weight"], a)
    assert torch.equal(saved[f"{prefix}.lora_B.weight"], b)
    with pytest.raises(BatchError, match="lora_rank 8"):
        write_peft_adapter(tmp_path / "x", names, {"lora_rank": 8})

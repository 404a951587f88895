"""hybridflow.models: built-in tokenizer, presets, local loading, save/load round trip."""

from __future__ import annotations

import pytest
import torch

from hybridflow.errors import ConfigError
from hybridflow.models import (
    ModelOptions,
    builtin_tokenizer,
    count_parameters,
    load_model,
    load_tokenizer,
    resolve_model,
    save_pretrained,
)
from hybridflow.models.tokenizer import _trained_json


def test_builtin_tokenizer_is_deterministic_and_lossless():
    _trained_json.cache_clear()
    first = builtin_tokenizer().backend_tokenizer.to_str()
    _trained_json.cache_clear()
    second = builtin_tokenizer().backend_tokenizer.to_str()
    assert first == second
    tok = builtin_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert tok.padding_side == "left" and tok.chat_template is None
    assert 150 <= len(tok) <= 192
    for text in ("last:40719=", "Explain quantum computing\nin  simple terms.", "odd"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    # Digits are single tokens whatever surrounds them.
    assert tok.convert_ids_to_tokens(tok("x1234=", add_special_tokens=False)["input_ids"])[
        1:5
    ] == list("1234")


def test_presets_build_seeded_and_real_shapes_on_meta():
    tok = builtin_tokenizer()
    a = load_model(ModelOptions(model="tiny"), tok, seed=3)
    b = load_model(ModelOptions(model="preset:tiny"), tok, seed=3)
    c = load_model(ModelOptions(model="tiny"), tok, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert a.config.vocab_size == len(tok) and not a.training
    assert type(load_model(ModelOptions(model="tiny-llama"), tok)).__name__ == "LlamaForCausalLM"
    vllm_cfg = load_model(ModelOptions(model="tiny-vllm"), tok).config
    assert vllm_cfg.hidden_size // vllm_cfg.num_attention_heads == 64
    # Real shapes, counted without allocating (meta device).
    sizes = {
        name: count_parameters(load_model(ModelOptions(model=name), tok, device="meta")) / 1e6
        for name in ("qwen2-0.5b", "qwen2-1.5b", "qwen2-7b")
    }
    assert 490 < sizes["qwen2-0.5b"] < 500
    assert 1500 < sizes["qwen2-1.5b"] < 1600
    assert 7500 < sizes["qwen2-7b"] < 7700


def test_value_and_reward_kinds_have_one_output_and_no_dropout():
    tok = builtin_tokenizer()
    ids = torch.tensor([[5, 6, 7, 8]])
    value = load_model(ModelOptions(model="tiny"), tok, kind="value")
    assert value(ids).logits.shape == (1, 4, 1)
    reward = load_model(ModelOptions(model="tiny"), tok, kind="reward")
    assert reward(ids).logits.shape == (1, 1)
    for model in (value, reward):
        assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_save_pretrained_round_trip(tmp_path):
    tok = builtin_tokenizer()
    model = load_model(ModelOptions(model="tiny", model_overrides={"num_hidden_layers": 1}), tok)
    save_pretrained(model, tok, tmp_path / "m")
    assert resolve_model(str(tmp_path / "m")) == ("dir", str(tmp_path / "m"))
    tok2 = load_tokenizer(None, str(tmp_path / "m"))
    loaded = load_model(ModelOptions(model=str(tmp_path / "m")), tok2, seed=99)
    assert loaded.config.num_hidden_layers == 1
    text = "copy:472="
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
    assert tok2.pad_token_id == tok.pad_token_id and tok2.padding_side == "left"
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    # The critic can start from the same causal-LM directory (trunk loaded, head new).
    value = load_model(ModelOptions(model=str(tmp_path / "m")), tok2, kind="value", seed=0)
    assert torch.equal(value.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_missing_or_bad_paths_are_config_errors(tmp_path):
    tok = builtin_tokenizer()
    with pytest.raises(ConfigError, match="never downloaded"):
        load_model(ModelOptions(model=str(tmp_path / "nope")), tok, path="stages.actor.options")
    with pytest.raises(ConfigError, match=r"Qwen/Qwen2-0\.5B"):
        resolve_model("Qwen/Qwen2-0.5B")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"without config\.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="unknown model preset"):
        resolve_model("preset:huge")
    with pytest.raises(ConfigError, match="not a Qwen2Config field"):
        load_model(ModelOptions(model="tiny", model_overrides={"num_layerz": 1}), tok)
    with pytest.raises(ConfigError, match="no tokenizer directory"):
        load_tokenizer(str(tmp_path / "nope"))


def test_bf16_autocast_keeps_float32_weights():
    tok = builtin_tokenizer()
    ref = load_model(ModelOptions(model="tiny"), tok)
    amp = load_model(ModelOptions(model="tiny", autocast_bf16=True), tok)
    assert all(p.dtype == torch.float32 for p in amp.parameters())
    ids = torch.tensor([tok("last:123=")["input_ids"]])
    with torch.no_grad():
        a, b = ref(ids).logits, amp(ids).logits
    assert b.dtype == torch.bfloat16 and float((a - b.float()).abs().max()) < 0.05
    loss = amp(ids).logits.float().logsumexp(-1).sum()
    loss.backward()  # gradients reach the float32 weights
    assert amp.model.embed_tokens.weight.grad is not None

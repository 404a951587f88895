"""`fp32_lm_head`: the output head computes in float32 under bf16, over the same
parameters (ties, state-dict keys and training unchanged)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.errors import ConfigError
from hybridflow.models.heads import FP32Linear, use_fp32_head
from hybridflow.models.loader import ModelOptions, load_model, load_tokenizer

TOK = load_tokenizer("builtin")
IDS = torch.randint(2, 150, (2, 7), generator=torch.Generator().manual_seed(0))


def _model(kind: str = "causal_lm", **opts: object) -> torch.nn.Module:
    return load_model(ModelOptions(model="tiny", tokenizer="builtin", **opts), TOK, kind=kind)


def test_bf16_logits_in_float32_equal_the_fp32_matmul_of_the_same_hidden_states():
    plain = _model(dtype="bfloat16")
    fp32 = _model(dtype="bfloat16", fp32_lm_head=True)
    assert isinstance(fp32.lm_head, FP32Linear) and fp32.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        hidden = plain.model(input_ids=IDS).last_hidden_state  # [B, T, H] bf16, same body
        want = hidden.float() @ plain.lm_head.weight.float().T
        got = fp32(input_ids=IDS).logits
        rounded = plain(input_ids=IDS).logits
    assert got.dtype == torch.float32 and rounded.dtype == torch.bfloat16
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got, rounded.float())  # bf16 rounding is what it removes


def test_under_autocast_the_head_leaves_autocast():
    fp32 = _model(autocast_bf16=True, fp32_lm_head=True)
    plain = _model(autocast_bf16=True)
    with torch.no_grad():
        assert fp32(input_ids=IDS).logits.dtype == torch.float32
        assert plain(input_ids=IDS).logits.dtype == torch.bfloat16


def test_same_parameters_keys_and_gradients():
    plain, fp32 = _model(), _model(fp32_lm_head=True)
    assert list(plain.state_dict()) == list(fp32.state_dict())
    for (n, a), (_, b) in zip(plain.state_dict().items(), fp32.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert plain.config.tie_word_embeddings  # the tiny preset ties: the tie is kept
    assert fp32.lm_head.weight is fp32.model.embed_tokens.weight
    # in float32 the head changes nothing: equal logits, equal gradients
    for m in (plain, fp32):
        m.train()
        m(input_ids=IDS).logits.logsumexp(-1).sum().backward()
    assert torch.allclose(plain.lm_head.weight.grad, fp32.lm_head.weight.grad, atol=1e-6)


def test_value_and_reward_heads_and_a_second_call():
    for kind in ("value", "reward"):
        m = _model(kind, dtype="bfloat16", fp32_lm_head=True)
        assert isinstance(m.score, FP32Linear)
        with torch.no_grad():
            assert m(input_ids=IDS).logits.dtype == torch.float32
        use_fp32_head(m, kind)  # idempotent
        assert isinstance(m.score, FP32Linear)


def test_a_head_that_is_not_linear_is_refused_with_the_key():
    m = _model()
    m.lm_head = torch.nn.Sequential(m.lm_head)
    with pytest.raises(ConfigError, match=r"^actor.fp32_lm_head: needs a plain linear output head"):
        use_fp32_head(m, "causal_lm", "actor.fp32_lm_head")

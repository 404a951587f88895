"""The tiny random Qwen2 the vLLM tests run: vLLM-on-CPU compatible (head_dim 64)."""

from __future__ import annotations

import torch

VOCAB = 256
EOS = 2
PAD = 0


def tiny_qwen2(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval()

"""Output heads computed in float32 (the `fp32_lm_head` model option).

Under bf16 (bf16 weights, or fp32 weights under bf16 autocast) the output head's matmul
rounds every logit to bf16: about 3 significant digits, an error of ~0.03 nats on a logit
near 10. The rollout and the trainer compute their heads through different kernels (a
one-token decode with a KV cache against a full-sequence forward), so their rounding
differs, and that difference is most of the log-prob gap between what the rollout
reports and what the actor recomputes (`bench/RESULTS.md`, `bench.logprob_gap`): an
off-policy error in the PPO ratio that no algorithm asked for. Computing the head in
float32 in both removes that term (the MiniMax-M1 report found the same; SGLang has an
fp32 LM head switch for it).

`use_fp32_head` swaps the head module for an `FP32Linear` holding the SAME parameters
(tied embeddings stay tied; state-dict keys, optimizers, FSDP and weight sync see no
difference). Its forward leaves autocast and multiplies float32 copies: for bf16 weights
that is one cast of the head's weight per call, and an fp32 matmul of [tokens, H] x
[H, V], which costs real time on large vocabularies (measured, not assumed).

Consumes: a transformers model; produces: the same model, its head's logits float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hybridflow.errors import ConfigError

# The head of each model kind (models/loader.py): causal LMs predict tokens with
# `lm_head`; the critic (token classification) and the reward model (sequence
# classification) score with `score`.
HEAD_ATTR = {"causal_lm": "lm_head", "value": "score", "reward": "score"}


class FP32Linear(torch.nn.Linear):
    """nn.Linear whose forward runs in float32 whatever the autocast or weight dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)


def use_fp32_head(model: Any, kind: str, path: str = "fp32_lm_head") -> None:
    """Replace `model`'s output head by an FP32Linear over the same parameters."""
    name = HEAD_ATTR[kind]
    head = getattr(model, name, None)
    if type(head) is FP32Linear:
        return
    if type(head) is not torch.nn.Linear:
        raise ConfigError(
            path,
            f"needs a plain linear output head `{name}`; {type(model).__name__} has "
            f"{type(head).__name__}",
        )
    new = FP32Linear(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
    new.weight = head.weight  # the same Parameter: ties, optimizer state, FSDP unchanged
    if head.bias is not None:
        new.bias = head.bias
    new.train(head.training)
    setattr(model, name, new)

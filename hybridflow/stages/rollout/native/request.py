"""What goes into and comes out of the native engine: one request = one micro-batch.

  Request        prompts: list of [P_i] int64 token ids (no padding), each sampled n times
                 (row i*n+j = sample j of prompt i); SamplingParams; a seed; optionally a
                 `session` (one prompt, n = 1): the engine keeps the row's K/V after it
                 ends, and the session's next request, whose prompt extends this one's
                 prompt + output, prefills only what is new (multi-turn turns)
  RequestOutput  tokens [R, T] int64 (0 after each row's end), logprobs [R, T] float32 (0
                 there), lengths [R] int64, R = len(prompts) * n, T = longest row

Invariant: a request's samples are a function of its prompts, params, seed and the weights
alone (sampler.py says how), never of what else the engine runs at the same time.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from hybridflow.errors import BatchError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (reports temperature-1 log-probs)
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()  # empty: run to max_new_tokens (ignore EOS)

    @property
    def truncates(self) -> bool:
        """Whether sampling needs the sorted top-k/top-p path."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1)

    def check(self, where: str) -> None:
        if self.temperature < 0:
            raise BatchError(f"{where}: temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise BatchError(f"{where}: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise BatchError(f"{where}: top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1 or self.n < 1:
            raise BatchError(f"{where}: max_new_tokens and n must be >= 1")


@dataclass
class Request:
    prompts: list[torch.Tensor]  # each [P_i] int64, P_i >= 1
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    session: Hashable = None  # keep this row's K/V for the session's next request
    # per-row caps (len == rows, each in 1..params.max_new_tokens); None: params' cap for all
    max_new_tokens: list[int] | None = None

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.params.n


@dataclass
class RequestOutput:
    request_id: int
    tokens: torch.Tensor  # [R, T] int64
    logprobs: torch.Tensor  # [R, T] float32
    lengths: torch.Tensor  # [R] int64
    reused_tokens: int = 0  # prompt positions taken from the session's parked K/V

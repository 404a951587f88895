"""What the rollout backends (hf, vllm, native) share: the sampling options every backend
accepts, per-call sampling overrides, the generate metrics and the checkpoint state.

Every backend's options dataclass extends `HFRolloutOptions` (the name stays for configs
and code that import it); every backend class mixes in `RolloutState`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hybridflow.errors import BatchError, ConfigError
from hybridflow.models.loader import ModelOptions
from hybridflow.stages.base import Metrics, Params


@dataclass
class HFRolloutOptions(ModelOptions):
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    n: int = 1  # samples per prompt (GRPO group size)
    stop_on_eos: bool = True
    eos_token_id: int | None = None  # None: the tokenizer's and generation_config's EOS ids
    pad_token_id: int | None = None  # None: the tokenizer's pad id
    seed: int | None = None  # None: the run seed
    max_batch_size: int = 0  # rows generated together (0: the whole micro-batch)

    def validate(self, path: str) -> None:
        ModelOptions.validate(self, path)

        def bad(key: str, msg: str) -> ConfigError:
            return ConfigError(f"{path}.{key}" if path else key, msg)

        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise bad("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise bad("n", f"must be >= 1, got {self.n}")
        if self.temperature == 0 and self.n > 1:
            raise bad("n", f"greedy decoding (temperature 0) gives {self.n} identical samples")


_SAMPLING_OVERRIDES = ("temperature", "top_p", "top_k", "max_new_tokens", "n")


class RolloutState:
    """What the rollout backends (hf, vllm) share: per-call sampling overrides, the
    generate metrics, and the checkpoint state (the number of generate calls and the
    policy version loaded). Weights belong to the actor; a resumed run reshards before its
    first rollout, so they are not part of it."""

    backend_name: str
    opts: Any  # the backend's options (an HFRolloutOptions or subclass), set in setup
    calls: int
    policy_version: int | None

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "policy_version": self.policy_version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = int(state.get("calls", 0))
        self.policy_version = state.get("policy_version")

    def _call_options(self, params: Params) -> Any:
        """The options of one generate call: the backend's, with sampling overrides."""
        assert self.opts is not None
        given = {k: params[k] for k in _SAMPLING_OVERRIDES if params.get(k) is not None}
        merged = replace(self.opts, **given)
        try:
            merged.validate("params")
        except ConfigError as exc:
            raise BatchError(f"{self.backend_name} rollout: bad generate params: {exc}") from exc
        return merged

    def _generate_metrics(self, gen_s: float, tokens: int, rows: int) -> Metrics:
        metrics = {
            "rollout/gen_s": gen_s,
            "rollout/tokens": float(tokens),
            "rollout/tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
            "rollout/response_len_mean": tokens / rows,
        }
        if self.policy_version is not None:
            metrics["rollout/policy_version"] = float(self.policy_version)
        return metrics


# What every rollout backend's `generate` declares (the contract all three speak).
GENERATE_INPUTS = ("prompt_ids", "prompt_mask")
GENERATE_OUTPUTS = (
    "prompt_ids",
    "prompt_mask",
    "response_ids",
    "response_mask",
    "rollout_logprobs",
    "group_index",
)

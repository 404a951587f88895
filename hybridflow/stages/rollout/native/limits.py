"""The native backend's limits, checked from its options and the model's config alone.

Consumes the role's options and the model's config as data: a preset's shape (with its
`model_overrides`) or a model directory's config.json at plan time (`hybridflow validate`,
before any process starts: no model is built, nothing heavier than json is read), the
built model's `config` at setup. Produces the slot length every sequence gets and raises
ConfigError, naming the option, for what the engine could not run:

  max_prompt_len    None (the default) -> min(512, room) where room = the model's positions
                    (a Mistral sliding window's, if smaller, rounded down to the slot
                    alignment) - max_new_tokens: a 512-position model runs as it is
  max_prompt_len + max_new_tokens > the model's positions            -> .max_prompt_len
  max_new_tokens alone leaves no room for a prompt                   -> .max_new_tokens
  an architecture the engine does not run, sliding-window layers      -> .model
  kv_cache_gb too small for one slot (paged: one sequence's blocks)  -> .kv_cache_gb

Invariant: plan time and setup apply the same rules (`check`) to the same facts, so a
config `validate` accepts fails at setup only for what needs the built model (its module
layout) or the device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.errors import ConfigError
from hybridflow.models.loader import DTYPES
from hybridflow.stages.rollout.native.forward.model import SUPPORTED_ARCHS
from hybridflow.stages.rollout.native.kv_cache import ALIGN, GIB, round_up, slot_bytes

DEFAULT_MAX_PROMPT_LEN = 512  # keeps slots (and so the KV cache per sequence) modest


@dataclass(frozen=True)
class ModelFacts:
    """What the limits need from a model's config (None: not known, not checked)."""

    arch: str | None
    positions: int | None  # max_position_embeddings
    window: int | None  # Mistral's sliding window (the engine attends to every position)
    sliding_layers: bool  # any sliding-window attention layer
    layers: int | None
    kv_heads: int | None
    head_dim: int | None

    @classmethod
    def of(cls, cfg: Any) -> ModelFacts:
        """From a config: a dict (config.json, a preset's shape) or a PretrainedConfig."""
        get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
        arch = get("model_type")
        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        head_dim = get("head_dim") or (hidden // heads if hidden and heads else None)
        kinds = set(get("layer_types") or ["full_attention"])
        return cls(
            arch=arch,
            positions=get("max_position_embeddings"),
            window=get("sliding_window") if arch == "mistral" else None,
            sliding_layers=kinds != {"full_attention"} or bool(get("use_sliding_window")),
            layers=get("num_hidden_layers"),
            kv_heads=get("num_key_value_heads") or heads,
            head_dim=head_dim,
        )


def model_facts(opts: Any, path: str) -> ModelFacts:
    """The facts of `opts.model` without building it: a preset's shape and overrides, or
    a model directory's config.json."""
    from hybridflow.models.loader import resolve_model
    from hybridflow.models.presets import get_preset

    source, ref = resolve_model(opts.model, f"{path}.model")
    if source == "preset":
        preset = get_preset(ref, f"{path}.model")
        return ModelFacts.of({"model_type": preset.arch, **preset.shape, **opts.model_overrides})
    try:
        cfg = json.loads((Path(ref) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}.model", f"cannot read {ref}/config.json: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}.model", f"{ref}/config.json is not a JSON object")
    return ModelFacts.of(cfg)


def check(opts: Any, facts: ModelFacts, path: str) -> int:
    """The limits of the module docstring; returns the max_prompt_len to run with."""

    def bad(key: str, msg: str) -> ConfigError:
        return ConfigError(f"{path}.{key}" if path else key, msg)

    if facts.arch is not None and facts.arch not in SUPPORTED_ARCHS:
        raise bad(
            "model",
            f"the native rollout engine runs {', '.join(SUPPORTED_ARCHS)} causal LMs; this "
            f"model is {facts.arch!r}; use the hf backend for it",
        )
    if facts.sliding_layers:
        raise bad("model", "sliding-window attention layers are not supported by the native engine")
    new = opts.max_new_tokens
    limit, what = facts.positions, f"the model's {facts.positions} positions"
    if facts.window is not None and (limit is None or facts.window < limit):
        limit = facts.window // ALIGN * ALIGN  # a slot is rounded up to ALIGN positions
        what = f"Mistral's sliding window of {facts.window} positions ({limit} in whole slots)"
    prompt = opts.max_prompt_len
    if prompt is None:
        if limit is not None and limit - new < 1:
            raise bad("max_new_tokens", f"{new} new tokens leave no room for a prompt in {what}")
        prompt = (
            DEFAULT_MAX_PROMPT_LEN if limit is None else min(DEFAULT_MAX_PROMPT_LEN, limit - new)
        )
    elif limit is not None and prompt + new > limit:
        raise bad(
            "max_prompt_len",
            f"max_prompt_len {prompt} + max_new_tokens {new} exceeds {what}; lower one, or "
            "leave max_prompt_len unset to fit the model",
        )
    if None not in (facts.layers, facts.kv_heads, facts.head_dim):
        itemsize = 2 if opts.autocast_bf16 else DTYPES[opts.dtype].itemsize
        need = slot_bytes(facts.layers, facts.kv_heads, facts.head_dim, prompt + new, itemsize)
        block = getattr(opts, "kv_block_size", 0)
        if block:  # paged: one whole sequence's blocks and the scratch block
            blocks = -(-round_up(prompt + new) // block) + 1
            need = need * blocks * block // round_up(prompt + new)
        if int(opts.kv_cache_gb * GIB) < need:
            raise bad(
                "kv_cache_gb",
                f"{opts.kv_cache_gb} GiB holds no sequence: one slot of "
                f"{round_up(prompt + new)} positions (prompt + max_new_tokens) needs "
                f"{need / GIB:.3g} GiB; raise kv_cache_gb or lower max_prompt_len / "
                "max_new_tokens",
            )
    return prompt

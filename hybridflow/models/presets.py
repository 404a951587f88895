"""Named model-config presets: tiny shapes for CPU tests/demos, real shapes for GPU benchmarks.

Consumes a preset name plus the tokenizer's vocabulary size and special-token ids;
produces a `transformers.PretrainedConfig` (never weights: `factory.py` builds the model).

Invariants:
  - tiny presets take `vocab_size` from the tokenizer (a model must never sample an id
    its tokenizer cannot decode); real-shape presets keep their real vocabulary and only
    check that the tokenizer fits in it;
  - dropout is 0 everywhere (RL convention: log-probs of the same tokens must not change
    between the rollout and the training forward);
  - building a config is cheap and allocates nothing, so real shapes can be listed and
    inspected on a CPU machine (on the meta device) without 7B parameters in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.errors import ConfigError


@dataclass(frozen=True)
class Preset:
    arch: str  # "qwen2" | "llama" | "qwen3" | "mistral"
    description: str
    shape: dict[str, Any] = field(default_factory=dict)
    vocab_size: int | None = None  # None: the tokenizer's size (tiny presets)


_TINY = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,  # head_dim 16
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)

# Qwen3 sets head_dim apart from hidden_size / heads (128 in the released models).
_TINY_QWEN3 = {**_TINY, "head_dim": 32}
# Mistral is Llama's layout plus a sliding window (4096 by default): off for the twin.
_TINY_MISTRAL = {**_TINY, "sliding_window": None}

# What the small Qwen3 releases share (0.6B and 1.7B differ only in width).
_QWEN3 = dict(
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

PRESETS: dict[str, Preset] = {
    "tiny": Preset("qwen2", "Qwen2-shaped, 2 layers, hidden 64 (~0.1M params): CPU tests", _TINY),
    "tiny-llama": Preset("llama", "Llama-shaped twin of `tiny`", _TINY),
    "tiny-mistral": Preset(
        "mistral", "Mistral-shaped twin of `tiny` (no sliding window)", _TINY_MISTRAL
    ),
    "tiny-qwen3": Preset(
        "qwen3", "Qwen3-shaped twin of `tiny` (per-head q/k RMSNorm, head_dim 32)", _TINY_QWEN3
    ),
    # vLLM's CPU attention kernel rejects head_dim 16; this one is what vLLM-on-CPU runs.
    "tiny-vllm": Preset(
        "qwen2",
        "Qwen2-shaped, 2 layers, hidden 128, head_dim 64: for vLLM on CPU",
        {**_TINY, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2},
    ),
    "small": Preset(
        "qwen2",
        "Qwen2-shaped, 4 layers, hidden 256, head_dim 64 (~3M params): CPU demos",
        {
            **_TINY,
            "hidden_size": 256,
            "intermediate_size": 768,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
    ),
    # Real shapes (Qwen2 technical report / released config.json files).
    "qwen2-0.5b": Preset(
        "qwen2",
        "Qwen2-0.5B shape (494M params), random init: GPU benchmarks",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        vocab_size=151936,
    ),
    "qwen2-1.5b": Preset(
        "qwen2",
        "Qwen2-1.5B shape (1.54B params), random init: GPU benchmarks",
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        vocab_size=151936,
    ),
    "qwen2-7b": Preset(
        "qwen2",
        "Qwen2-7B shape (7.6B params), random init: GPU benchmarks",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        vocab_size=152064,
    ),
    # Qwen3 (released config.json files): q/k RMSNorm per head, no qkv bias, head_dim 128.
    "qwen3-0.6b": Preset(
        "qwen3",
        "Qwen3-0.6B shape (596M params), random init: GPU benchmarks",
        {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072},
        vocab_size=151936,
    ),
    "qwen3-1.7b": Preset(
        "qwen3",
        "Qwen3-1.7B shape (1.7B params), random init: GPU benchmarks",
        {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144},
        vocab_size=151936,
    ),
}

# Every dropout-like attribute a transformers config may carry; forced to 0.
DROPOUT_KEYS = (
    "attention_dropout",
    "hidden_dropout",
    "classifier_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "dropout",
)


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str, path: str = "model") -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            path, f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}"
        ) from None


# The shape fields an override may resize, and the largest model a preset may become:
# a typo such as `hidden_size: 100000000` must fail at validate naming its key, not as
# an allocation error deep inside model construction.
_SIZE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "vocab_size",
    "head_dim",
)
MAX_SIZE = 1 << 20  # any one dimension
MAX_PARAMS = 200_000_000_000  # ~ 800 GB in float32


def check_overrides(name: str, overrides: dict[str, Any], path: str) -> None:
    """Values of `model_overrides` (ConfigError naming `<path>.<key>`): scalars, finite
    numbers, sizes in 1..MAX_SIZE, and a model of at most MAX_PARAMS parameters (an
    estimate from the preset's shape: embeddings + attention + MLP per layer)."""
    import math

    for key, value in overrides.items():
        sub = f"{path}.{key}"
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(sub, f"must be a finite number, got {value!r}")
        if key in _SIZE_KEYS:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(sub, f"must be an int, got {type(value).__name__} {value!r}")
            if not 1 <= value <= MAX_SIZE:
                raise ConfigError(sub, f"must be in 1 .. {MAX_SIZE}, got {value}")
        elif value is not None and not isinstance(value, (bool, int, float, str)):
            raise ConfigError(sub, f"must be a scalar, got {type(value).__name__}")
    preset = PRESETS.get(name)
    if preset is None:
        return
    shape = {**preset.shape, **overrides}
    h, i = int(shape.get("hidden_size", 0)), int(shape.get("intermediate_size", 0))
    layers = int(shape.get("num_hidden_layers", 0))
    vocab = int(shape.get("vocab_size", preset.vocab_size or 0))
    params = layers * (4 * h * h + 3 * h * i) + 2 * vocab * h
    if params > MAX_PARAMS:
        raise ConfigError(
            path,
            f"would make preset {name!r} a model of ~{params:.3g} parameters (at most "
            f"{MAX_PARAMS:.0e}); check hidden_size, intermediate_size, num_hidden_layers",
        )


def preset_config(
    name: str,
    *,
    vocab_size: int,
    pad_token_id: int | None,
    eos_token_id: int | None,
    bos_token_id: int | None,
    overrides: dict[str, Any] | None = None,
    path: str = "model",
) -> Any:
    """The `PretrainedConfig` of preset `name` for a tokenizer of `vocab_size` tokens.

    `overrides` replace config fields (e.g. `num_hidden_layers`); unknown field names
    raise ConfigError rather than silently becoming inert config attributes.
    """
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    preset = get_preset(name, path)
    classes = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config}
    cls = {**classes, "mistral": MistralConfig}[preset.arch]
    kwargs: dict[str, Any] = dict(preset.shape)
    if preset.vocab_size is None:
        kwargs["vocab_size"] = vocab_size
    else:
        if vocab_size > preset.vocab_size:
            raise ConfigError(
                path,
                f"the tokenizer has {vocab_size} tokens but preset {name!r} only "
                f"{preset.vocab_size} embeddings; use a smaller tokenizer",
            )
        kwargs["vocab_size"] = preset.vocab_size
    known = set(cls().to_dict())
    for key, value in (overrides or {}).items():
        if key not in known:
            raise ConfigError(f"{path}_overrides.{key}", f"not a {cls.__name__} field")
        kwargs[key] = value
    cfg = cls(
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
        **kwargs,
    )
    for key in DROPOUT_KEYS:
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    return cfg

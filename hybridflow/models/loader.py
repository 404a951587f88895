"""Load models and tokenizers from local directories, or build them from presets.

Consumes a `ModelOptions` (a role's `options:` block: `model`, `tokenizer`, `dtype`, ...)
and produces a tokenizer plus one of three model kinds:

  causal_lm  AutoModelForCausalLM                        logits [B, T, V]
  value      AutoModelForTokenClassification, 1 label    causal LM trunk + linear head
                                                        -> values [B, T] (the critic)
  reward     AutoModelForSequenceClassification, 1 label -> one score per sequence

`model` is a local directory holding `config.json` (a `save_pretrained` output), or a
preset name (`tiny`, `preset:tiny`, ...; see presets.py) built with random init.

Invariants:
  - nothing is ever downloaded: directories load with `local_files_only=True`, remote
    code is never trusted, and a path that does not exist is a ConfigError naming it;
  - building the same preset with the same seed gives bit-identical weights in any
    process and on any device (actor, reference and rollout start from one policy
    without shipping it; presets are initialised on CPU unless `init_device: device`);
    the global RNG is left untouched (init runs inside `fork_rng`);
  - dropout is off in every model (RL log-probs must be deterministic functions of the
    weights); every model comes back in eval mode on the requested device and dtype.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from hybridflow.errors import ConfigError
from hybridflow.models import varlen
from hybridflow.models.heads import use_fp32_head
from hybridflow.models.presets import DROPOUT_KEYS, PRESETS, check_overrides, preset_config
from hybridflow.models.tokenizer import builtin_tokenizer

ModelKind = Literal["causal_lm", "value", "reward"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class ModelOptions:
    """The model part of a role's options (roles extend this dataclass)."""

    model: str = ""  # local directory with config.json, or a preset name (`tiny`)
    tokenizer: str | None = None  # directory or "builtin"; default: the model's own
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # the weights' dtype
    init_seed: int | None = None  # random init of presets / new heads; None: the run seed
    init_device: Literal["cpu", "device"] = "cpu"  # where presets are initialised (see load_model)
    # Mixed precision: keep `dtype` weights (float32: the optimizer's master copy) and run
    # every forward under bfloat16 autocast. Pure bfloat16 training (dtype: bfloat16)
    # loses updates smaller than bf16's resolution; this does not.
    autocast_bf16: bool = False
    # transformers' attention kernel. For packed documents (pack_sequences), where sdpa
    # computes a T x T mask: varlen (models/varlen.py: torch's varlen flash kernel on a
    # GPU, sdpa everywhere else) or flex_attention (torch.compile'd; GPU; a BlockMask)
    attn_implementation: Literal["sdpa", "eager", "flex_attention", "varlen"] = "sdpa"
    # The output head (lm_head; a critic's or reward model's score head) in float32 even
    # under bf16: rollout and trainer log-probs then differ by less (models/heads.py).
    fp32_lm_head: bool = False
    model_overrides: dict[str, Any] = field(default_factory=dict)  # preset config fields

    def validate(self, path: str) -> None:
        if not self.model:
            raise ConfigError(
                f"{path}.model" if path else "model",
                f"is required: a local model directory or a preset ({', '.join(PRESETS)})",
            )
        if self.model_overrides:
            name = self.model.removeprefix("preset:")
            sub = f"{path}.model_overrides" if path else "model_overrides"
            check_overrides(name, self.model_overrides, sub)


def resolve_model(spec: str, path: str = "model") -> tuple[Literal["dir", "preset"], str]:
    """('dir', path) for a model directory, ('preset', name) for a preset; else ConfigError.

    An existing directory wins over a preset of the same name; `preset:NAME` forces one.
    """
    if spec.startswith("preset:"):
        name = spec.removeprefix("preset:")
        if name not in PRESETS:
            raise ConfigError(path, f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
        return "preset", name
    p = Path(spec).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ConfigError(
                path, f"{str(p)!r} is a directory without config.json; not a saved model"
            )
        return "dir", str(p)
    if spec in PRESETS:
        return "preset", spec
    raise ConfigError(
        path,
        f"no model directory at {spec!r} (models are never downloaded: give a local "
        f"directory written by save_pretrained, or a preset: {', '.join(PRESETS)})",
    )


def load_tokenizer(spec: str | None, model: str | None = None, path: str = "tokenizer") -> Any:
    """Tokenizer from `spec` ("builtin" or a directory), else from the model directory,
    else the built-in one for presets. A pad token is guaranteed (eos if none); padding
    is on the left (batched generation needs it)."""
    if spec == "builtin":
        return builtin_tokenizer()
    if spec:
        directory = Path(spec).expanduser()
        if not directory.is_dir():
            raise ConfigError(path, f"no tokenizer directory at {spec!r} (nothing is downloaded)")
    elif model is not None and resolve_model(model)[0] == "dir":
        directory = Path(model).expanduser()
        if not any((directory / f).is_file() for f in _TOKENIZER_FILES):
            raise ConfigError(
                path,
                f"model directory {model!r} has no tokenizer files; set `tokenizer:` to a "
                "tokenizer directory or 'builtin'",
            )
    else:
        return builtin_tokenizer()
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    _quiet_transformers()
    # transformers 5 AutoTokenizer picks the tokenizer class from config.json's model_type
    # when tokenizer_config.json names only the generic class, and the Qwen2 class then
    # replaces the saved pre-tokenizer with its own: a directory holding the built-in
    # tokenizer beside a Qwen2 model would load with different token ids. A generic
    # tokenizer.json is therefore loaded as exactly what it says.
    cls = (
        PreTrainedTokenizerFast
        if _tokenizer_class(directory) in _GENERIC_TOKENIZERS
        else AutoTokenizer
    )
    try:
        tok = cls.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(path, f"cannot load a tokenizer from {str(directory)!r}: {exc}") from exc
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ConfigError(path, f"tokenizer at {str(directory)!r} has neither pad nor eos")
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_class(directory: Path) -> str | None:
    try:
        cfg = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("tokenizer_class") if isinstance(cfg, dict) else None


def load_model(
    opts: ModelOptions,
    tokenizer: Any,
    *,
    kind: ModelKind = "causal_lm",
    device: torch.device | str = "cpu",
    seed: int = 0,
    path: str = "options",
) -> torch.nn.Module:
    """Build or load the model of `opts` as `kind`; eval mode, no dropout, on `device`.

    `seed` drives random init (presets, and heads that a directory lacks, e.g. a value
    head on a causal-LM checkpoint); `opts.init_seed` overrides it.
    """
    source, ref = resolve_model(opts.model, f"{path}.model")
    init_seed = opts.init_seed if opts.init_seed is not None else seed
    dtype = DTYPES[opts.dtype]
    device = torch.device(device)
    cls = _auto_class(kind)
    _quiet_transformers()
    if opts.attn_implementation == varlen.NAME:
        varlen.register()
    with torch.random.fork_rng(devices=_cuda_devices(device)):
        torch.manual_seed(init_seed)
        if source == "preset":
            cfg = preset_config(
                ref,
                vocab_size=len(tokenizer),
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.bos_token_id,
                overrides=opts.model_overrides,
                path=f"{path}.model",
            )
            _prepare_config(cfg, kind)
            # CPU and CUDA draw different random streams from one seed: initialising on
            # CPU gives the same weights whatever device each role runs on (a reference
            # on CPU equals an actor on GPU). `init_device: device` skips the host copy
            # (large presets in benchmarks) at the price of that guarantee.
            on_device = opts.init_device == "device" or device.type == "meta"  # meta: shapes only
            init_dev = device if on_device else torch.device("cpu")
            with torch.device(init_dev):
                model = cls.from_config(cfg, attn_implementation=opts.attn_implementation)
            model = model.to(device=device, dtype=dtype)
        else:
            if opts.model_overrides:
                raise ConfigError(
                    f"{path}.model_overrides", "only applies to presets, not to a model directory"
                )
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(ref, local_files_only=True, trust_remote_code=False)
            _prepare_config(cfg, kind)
            if cfg.pad_token_id is None:
                cfg.pad_token_id = tokenizer.pad_token_id
            model = cls.from_pretrained(
                ref,
                config=cfg,
                local_files_only=True,
                trust_remote_code=False,
                attn_implementation=opts.attn_implementation,
                **{_dtype_kwarg(): dtype},
            ).to(device)
    vocab = model.config.vocab_size
    if len(tokenizer) > vocab:
        raise ConfigError(
            f"{path}.tokenizer",
            f"tokenizer has {len(tokenizer)} tokens but the model only {vocab} embeddings",
        )
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if opts.fp32_lm_head:
        use_fp32_head(model, kind, f"{path}.fp32_lm_head")
    if opts.autocast_bf16 and device.type != "meta":
        # Wrapping this instance's forward covers every caller (roles, generate, ...).
        model.forward = torch.autocast(device.type, dtype=torch.bfloat16)(model.forward)
    return model.eval()


def save_pretrained(
    model: torch.nn.Module,
    tokenizer: Any,
    directory: str | Path,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write model (safetensors) + tokenizer so `load_model`/`load_tokenizer` (and plain
    transformers / vLLM) load them back from `directory`. `state_dict`: the full weights
    when the model's own are sharded (FSDP gathers them first)."""
    _quiet_transformers()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if state_dict is None:
        model.save_pretrained(str(out), safe_serialization=True)
    else:
        model.save_pretrained(str(out), safe_serialization=True, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def _auto_class(kind: ModelKind) -> Any:
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    classes = {
        "causal_lm": AutoModelForCausalLM,
        "value": AutoModelForTokenClassification,
        "reward": AutoModelForSequenceClassification,
    }
    return classes[kind]


def _prepare_config(cfg: Any, kind: ModelKind) -> None:
    for key in DROPOUT_KEYS:
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    if kind != "causal_lm":
        cfg.num_labels = 1
        # Without this, transformers' classification heads fall back to dropout 0.1.
        cfg.classifier_dropout = 0.0


def _dtype_kwarg() -> str:
    import transformers

    return "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


def _cuda_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


_quieted = False


def _quiet_transformers() -> None:
    """Progress bars of weight loading/saving would garble the run's console."""
    global _quieted
    if not _quieted:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        _quieted = True


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

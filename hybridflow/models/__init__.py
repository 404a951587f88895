"""Models and tokenizers: local HF directories, named presets with random init, and the
built-in tokenizer. See loader.py (what loads/builds), presets.py (shapes), tokenizer.py."""

from hybridflow.models.loader import (
    DTYPES,
    ModelOptions,
    count_parameters,
    load_model,
    load_tokenizer,
    resolve_model,
    save_pretrained,
)
from hybridflow.models.presets import PRESETS, preset_config, preset_names
from hybridflow.models.tokenizer import builtin_tokenizer

__all__ = [
    "DTYPES",
    "PRESETS",
    "ModelOptions",
    "builtin_tokenizer",
    "count_parameters",
    "load_model",
    "load_tokenizer",
    "preset_config",
    "preset_names",
    "resolve_model",
    "save_pretrained",
]

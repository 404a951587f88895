"""`compile_layers`: the training roles' decoder layers through torch.compile (issue 25).

Profiled on an H200 (bench/actor_profile.py, bench/RESULTS.md): an actor `update` of
`grpo-gpu-real`'s shapes spends about a quarter of its device time in GEMMs and most of
the rest in elementwise kernels (RMSNorm's eight ops, RoPE, SiLU*mul, residual adds,
autocast's casts), each a pass over [tokens, hidden] forward and backward. Compiling
each decoder layer (as torchtitan compiles each block) lets inductor fuse them.

dynamic=True: the actor's forwards come in many shapes (token-budget groups, each cut
to its own longest row), and one compilation with symbolic sizes serves them all.
Refused with FSDP for now (the shards' hooks run inside the compiled call; not measured).
"""

from __future__ import annotations

from typing import Any

from hybridflow.errors import ConfigError


def decoder_layers(model: Any) -> list[Any] | None:
    """The transformer blocks of an HF model (under peft's wrapper too), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(base, "model", None)
    layers = getattr(body, "layers", None)
    return list(layers) if layers is not None else None


def compile_layers(on: bool, model: Any, sharded: bool, path: str) -> int:
    """Compile each decoder layer in place (module.compile) if `on`; returns how many."""
    if not on:
        return 0
    key = f"{path}.compile_layers" if path else "compile_layers"
    if sharded:
        raise ConfigError(key, "is not supported with a sharded model (fsdp) yet")
    layers = decoder_layers(model)
    if not layers:
        raise ConfigError(key, f"{type(model).__name__} has no model.layers to compile")
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)

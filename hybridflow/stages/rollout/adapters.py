"""Unmerged LoRA adapters on a rollout engine (hf, native; vLLM's own LoRA support is
vllm_lora.py): the engine's model holds the
actor's adapters beside its base weights and computes base + scaling * B @ A at every
forward, so a weight sync after the first needs to move only the adapters (megabytes).

When: the actor's `lora_sync: adapters` (stages/actor_sync.py). The stage host calls the
rollout's `hold_adapters(lora, seed)` after setup (pipeline/plan/weight_links.py
`adapter_syncs` says which rollout roles hold which actor's adapters); `hold` wraps the
model with the actor's peft config (same rank, alpha, targets; dropout off), and
`AdapterWeights` takes its updates.

An update comes in one of three forms (by its names), and the sink checks each whole:
  full      every parameter under the wrapped names (`.base_layer.`, lora_A/B, the rest):
            the actor's first sync on a link. It writes the actor's base into the engine,
            so the base is the actor's whatever the rollout built (other dtype, init seed
            or model directory of the same shape): no bit-identity is assumed.
  adapters  every lora_A / lora_B weight and nothing else: later syncs (the base is
            frozen). Refused until a full update has landed.
  merged    the base model's names (a merged sync, a checkpoint's policy on resume): the
            merged weights go into the base layers and every lora_B is zeroed, so the model
            computes exactly them; the base slot then holds a policy, not the base, so
            adapter-only updates are refused again until the next full one.

Why it just works in the native engine: its forwards call the HF modules (`attn.q_proj(h)`,
`layer.mlp(...)`), and peft replaces those modules in place with its LoRA Linear, whose
forward (dropout 0, no grad) is base_layer(x) + lora_B(lora_A(x)) * scaling with no
data-dependent control flow (its branches read flags fixed between syncs): the same
kernels every step, static shapes, parameters updated in place, so a captured CUDA graph
replays it (graphs are re-captured once, after wrapping, and when aliasing replaces a
parameter's storage).

Invariants: after `hold`, every adapter parameter is frozen (no grad) and B = 0 until the
first sync (the model computes the base); a sampled model is always one complete update.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybridflow.errors import BatchError
from hybridflow.models.lora import Adapters, LoraOptions, base_name, is_adapter, is_lora_b, wrap
from hybridflow.stages.base import Metrics
from hybridflow.stages.common import mix_seed
from hybridflow.stages.rollout.weights import InPlaceWeights, Pairs, incomplete


def hold(model: torch.nn.Module, lora: Mapping[str, Any], *, seed: int, path: str) -> Adapters:
    """Wrap `model` (in place) with the adapters `lora` describes (the actor's
    lora_rank / lora_alpha / lora_target_modules), frozen, dropout off. `seed`: the run
    seed; A is initialised as the actor's (B is zero: the model computes the base)."""
    opts = LoraOptions(**dict(lora), lora_dropout=0.0)
    adapters = wrap(model, opts, kind="causal_lm", seed=mix_seed(seed, "lora"), path=path)
    assert adapters is not None, "hold: lora_rank must be > 0"
    model.requires_grad_(False)
    return adapters


class AdapterWeights(InPlaceWeights):
    """The weight sink of a rollout model wrapped by `hold` (the module docstring's forms)."""

    def __init__(self, model: torch.nn.Module, *, alias: bool = False) -> None:
        params = dict(model.named_parameters(remove_duplicate=False))
        # A merged update names a base layer's weight as the unwrapped model does.
        merged = {base_name(n): p for n, p in params.items() if base_name(n)}
        super().__init__({**params, **merged}, alias=alias)
        self.merged_names = set(merged)
        self.adapter_ids = {id(p) for n, p in params.items() if is_adapter(n)}
        self.lora_b = [p for n, p in params.items() if is_lora_b(n)]
        self.base_loaded = False  # a full update landed since the last merged one
        self._forms: set[str] = set()

    def begin(self) -> None:
        super().begin()
        self._forms = set()

    def feed(self, weights: Pairs) -> None:
        def tagged() -> Pairs:
            for name, tensor in weights:
                self._forms.add(self._form(name))
                yield name, tensor

        super().feed(tagged())

    def _form(self, name: str) -> str:
        if is_adapter(name):
            return "adapter"
        if name in self.merged_names:
            return "merged"
        return "wrapped" if base_name(name) else "shared"  # embeddings, norms, head

    def end(self) -> Metrics:
        self.updating = False
        forms, missing = self._forms, self._unwritten
        if "merged" in forms and forms & {"adapter", "wrapped"}:
            raise BatchError(
                "load_weights: an update mixes base-model names (merged weights) with the "
                "wrapped model's (.base_layer. / lora_A / lora_B); send one form"
            )
        if "merged" in forms:
            if missing - self.adapter_ids:
                raise incomplete(self.unwritten())
            self._zero_b()
            self.base_loaded = False
        elif forms == {"adapter"} and missing:
            if missing & self.adapter_ids:
                raise incomplete([n for n in self.unwritten() if is_adapter(n)])
            if not self.base_loaded:
                raise BatchError(
                    "load_weights: an adapter-only update, but this engine does not hold the "
                    "actor's base weights yet (the first sync of a link is full, and a merged "
                    "update since replaced them); the next full update restores them"
                )
        elif missing:
            raise incomplete(self.unwritten())
        else:
            self.base_loaded = True
        self.ok = True
        return {**self.metrics(), "reshard/adapters_only": float(forms == {"adapter"})}

    def _zero_b(self) -> None:
        with torch.no_grad():
            for p in self.lora_b:
                if self.alias:  # its storage may be the actor's: never write into it
                    p.data = torch.zeros_like(p)
                    self.replaced = True
                else:
                    p.zero_()

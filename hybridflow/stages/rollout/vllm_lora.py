"""Unmerged LoRA adapters on the vllm rollout: vLLM's own LoRA support holds the actor's
adapters beside the base weights, so a weight sync after the first moves only them.

When: the actor's `lora_sync: adapters` (stages/actor_sync.py); the stage host calls the
rollout's `hold_adapters(lora, seed)` after setup (pipeline/plan/weight_links.py
`adapter_syncs`). The engine is then rebuilt with LoRA enabled (vllm.py), and its updates
go through `AdapterSink`, which takes the three forms rollout/adapters.py describes:

  full      the wrapped model's names: `.base_layer.` weights go into the engine's base
            under the base model's names (vLLM's layer-wise reload, as a merged update),
            the rest (embeddings, norms, head) too; every lora_A / lora_B becomes a new
            adapter. The actor's first sync on a link.
  adapters  every lora_A / lora_B and nothing else: a new adapter, the base untouched
            (no reload is started). Refused until a full update has landed.
  merged    the base model's names only: the engine's base becomes that policy and no
            adapter runs; adapter-only updates are refused again until the next full one.

Each new adapter is a fresh LoRA request with a new int id. vLLM 0.31/0.32 load adapters
only from a path (no in-memory request type; verl patches vLLM's loader to get one, this
module does not), so the adapter is written as a PEFT adapter directory
(adapter_config.json + adapter_model.safetensors, peft's own key names) under a per-process
temporary directory, loaded at once (`vllm_compat.add_lora`), and removed when the next
adapter replaces it. The engine runs with max_loras = 1: one adapter, the current one,
which `generate` passes with every prompt (`AdapterSink.request`, None: the base alone).

Invariants: a sampled engine is one complete update (the base of the last full or merged
update and the adapter of the last full or adapter update, never a half of either); the
adapter of one update carries every lora_A / lora_B name of the first full update.
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from hybridflow.errors import BatchError
from hybridflow.models.lora import base_name, is_adapter
from hybridflow.stages.base import Metrics
from hybridflow.stages.rollout import vllm_compat
from hybridflow.stages.rollout.weights import Pairs, WeightSink


class _Engine(Protocol):
    """What the sink needs of the vllm rollout role (vllm.py), named here rather than
    imported so that vllm.py (which builds the sink) and this module form no circle."""

    llm: Any
    asleep: Any

    def wake_up(self, tags: list[str] | None = None) -> Any: ...


_PEFT_PREFIX = "base_model.model."  # peft's key prefix in adapter_model.safetensors


class AdapterSink(WeightSink):
    """The weight sink of a vllm rollout holding adapters (the module docstring's forms)."""

    failed = vllm_compat.WeightSyncError

    def __init__(self, role: _Engine, lora: Mapping[str, Any]) -> None:
        self.role = role
        self.lora = dict(lora)  # the actor's lora_rank / lora_alpha / lora_target_modules
        self.loader = vllm_compat.WeightUpdate(role.llm)
        self.dir = Path(tempfile.mkdtemp(prefix="hybridflow-vllm-lora-"))  # this process's
        self.request: Any = None  # the LoRARequest generate runs with; None: base only
        self.adapter_names: set[str] | None = None  # fixed by the first full update
        self.base_loaded = False  # the base is the actor's (a full update, no merged since)
        self._ids = itertools.count(1)
        self._pending: dict[str, torch.Tensor] = {}  # this update's adapters, CPU copies
        self._wrapped = False  # this update named a `.base_layer.` weight
        self._t0 = 0.0

    def begin(self) -> None:
        if "weights" in self.role.asleep:
            self.role.wake_up(["weights"])
        self.ok, self.updating, self._wrapped = False, True, False
        self._pending = {}
        self._t0 = time.perf_counter()

    def feed(self, weights: Pairs) -> None:
        it = iter(weights)
        try:
            for name, tensor in it:
                if is_adapter(name):
                    self._stash(name, tensor)
                    continue
                if not self.loader.active:  # the base changes: a reload starts
                    self.base_loaded = False
                    self.loader.start()
                self.loader.feed(self._bases(itertools.chain([(name, tensor)], it)))
                return
        except BaseException:
            self._close_failed()
            raise

    def _bases(self, pairs: Pairs) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream's base tensors under the base model's names; adapters set aside."""
        for name, tensor in pairs:
            if is_adapter(name):
                self._stash(name, tensor)
                continue
            plain = base_name(name)
            self._wrapped |= plain is not None
            yield plain or name, tensor

    def _stash(self, name: str, tensor: torch.Tensor) -> None:
        # A copy: the bucket's tensors may be transport views, leased until it is loaded.
        self._pending[name] = tensor.detach().to("cpu", copy=True).contiguous()

    def end(self) -> Metrics:
        try:
            form = self._finish()
        except BaseException:
            self._close_failed()
            raise
        self.updating, self.ok = False, True
        vllm_compat.reset_prefix_cache(self.role.llm)  # its K/V came from the old weights
        base = form != "adapters"  # the loader's counts are this update's
        nbytes = sum(t.numel() * t.element_size() for t in self._pending.values())
        metrics = {
            "timing/reshard": time.perf_counter() - self._t0,
            "reshard/bytes": float(nbytes + (self.loader.bytes if base else 0)),
            "reshard/tensors": float(len(self._pending) + (self.loader.tensors if base else 0)),
            "reshard/adapters_only": float(not base),
        }
        self._pending = {}
        return metrics

    def _finish(self) -> str:
        """Close the base reload (if any) and register the adapter -> the update's form."""
        base = self.loader.active
        if base:
            self.loader.finish()  # raises WeightSyncError if a base parameter is missing
        if not self._pending:
            if not base:
                raise BatchError("load_weights: an update without any tensor")
            if self._wrapped:
                raise BatchError(
                    "load_weights: a full update (`.base_layer.` names) without its "
                    "lora_A / lora_B weights"
                )
            self._drop_adapter()  # merged weights: the base alone computes them
            return "merged"
        if base and not self._wrapped:
            raise BatchError(
                "load_weights: an update mixes base-model names (merged weights) with "
                "lora_A / lora_B; send one form"
            )
        if not base and not self.base_loaded:
            raise BatchError(
                "load_weights: an adapter-only update, but this engine does not hold the "
                "actor's base weights yet (the first sync of a link is full, and a merged "
                "update since replaced them); the next full update restores them"
            )
        self._check_names(full=base)
        self._register()
        self.base_loaded = True
        return "full" if base else "adapters"

    def _check_names(self, *, full: bool) -> None:
        names = set(self._pending)
        if full:
            self.adapter_names = names
            return
        missing = sorted((self.adapter_names or set()) - names)
        extra = sorted(names - (self.adapter_names or set()))
        if missing or extra:
            raise BatchError(
                f"load_weights: an adapter-only update must carry every lora_A / lora_B "
                f"of the full one: {len(missing)} missing (e.g. {missing[:3]}), "
                f"{len(extra)} unknown (e.g. {extra[:3]})"
            )

    def _register(self) -> None:
        """The pending adapters as a new LoRA request; the one it replaces goes."""
        lora_id = next(self._ids)
        path = self.dir / f"adapter-{lora_id}"
        write_peft_adapter(path, self._pending, self.lora)
        request = vllm_compat.lora_request(f"actor-{lora_id}", lora_id, str(path))
        vllm_compat.add_lora(self.role.llm, request)
        self._drop_adapter()
        self.request = request

    def _drop_adapter(self) -> None:
        old, self.request = self.request, None
        if old is not None:
            vllm_compat.remove_lora(self.role.llm, old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def _close_failed(self) -> None:
        """After any error: the engine holds a mixed update and must not sample."""
        self.updating, self.ok = False, False
        self.loader.abort()  # a started base reload left the base mixed (base_loaded False)
        self._pending = {}

    def close(self) -> None:
        self.request = None
        shutil.rmtree(self.dir, ignore_errors=True)


def write_peft_adapter(
    path: Path, adapters: Mapping[str, torch.Tensor], lora: Mapping[str, Any]
) -> None:
    """A PEFT adapter directory as peft's `save_pretrained` writes it (what vLLM loads):
    `adapters` are the wrapped model's names (`x.q_proj.lora_A.default.weight`); the
    config takes rank and alpha from `lora` and the target modules from the names."""
    from safetensors.torch import save_file

    tensors = {_PEFT_PREFIX + _peft_key(name): t for name, t in adapters.items()}
    targets = sorted({name.split(".lora_", 1)[0].rsplit(".", 1)[-1] for name in adapters})
    rank = int(lora.get("lora_rank", 0))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": float(lora.get("lora_alpha", 16.0)),
        "target_modules": targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
    }
    shapes = {tuple(t.shape) for n, t in adapters.items() if ".lora_A." in n}
    if any(s[0] != rank for s in shapes):
        raise BatchError(
            f"load_weights: lora_A shapes {sorted(shapes)} do not have the actor's "
            f"lora_rank {rank} as their first dimension"
        )
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(config, indent=1))


def _peft_key(name: str) -> str:
    """`x.q_proj.lora_A.default.weight` -> `x.q_proj.lora_A.weight` (peft drops the
    adapter's name when it saves)."""
    for part in (".lora_A.", ".lora_B."):
        name = name.replace(f"{part}default.", part, 1)
    return name

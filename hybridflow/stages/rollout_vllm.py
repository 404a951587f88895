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

Log-probs: vLLM 0.32 returns *raw* log-probs by default (log_softmax of the model's logits,
before temperature/top-k/top-p). This backend starts the engine with
`logprobs_mode="processed_logprobs"`: the log-prob of each sampled token under the
distribution it was actually drawn from, after temperature and top-k/top-p (truncated
distributions are renormalised over the kept tokens). Without top-k/top-p that equals the
actor's recomputation `logprobs_from_logits(logits / temperature, tokens)`; tests/vllm
measures the agreement. With greedy decoding (temperature 0) they are the log-probs at
temperature 1.

Invariants:
  - the engine is built once in `setup` and lives in this process (vllm_compat);
  - after a failed or incomplete weight update `generate` raises until a complete update
    succeeds (never samples from mixed weights);
  - sampling is seeded per request (`seed` + row), so a micro-batch's samples do not
    depend on what else the engine is running.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hybridflow.config.loader import from_dict
from hybridflow.errors import BatchError, ConfigError
from hybridflow.stages import vllm_compat
from hybridflow.stages.base import Batch, Metrics, Params, StageContext


@dataclass
class VLLMRolloutConfig:
    """`options:` of a rollout stage with `backend: vllm`."""

    model: str  # local HF model directory (config.json + *.safetensors)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    n: int = 1  # samples per prompt (GRPO group size)
    stop_on_eos: bool = True
    eos_token_id: int | None = None  # None: from the model's generation_config/config
    pad_token_id: int | None = None  # None: the model's pad id, else its first EOS id
    seed: int | None = None  # None: the stage's seed
    dtype: str = "auto"  # engine dtype ("auto": the checkpoint's)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int | None = None  # None: vLLM's default
    enforce_eager: bool | None = None  # None: True on CPU (no compile), False on GPU
    kv_cache_bytes: int | None = None  # None: 256 MiB on CPU; on GPU gpu_memory_utilization
    # GPU only (ignored without CUDA):
    gpu_memory_utilization: float = 0.5
    sleep_mode: bool = True  # allow sleep/wake_up around training (colocated hybrid engine)
    sleep_level: int = 1  # 1: offload weights to host, 2: discard them (reshard restores)

    def validate(self, path: str) -> None:
        def bad(key: str, msg: str) -> ConfigError:
            return ConfigError(f"{path}.{key}" if path else key, msg)

        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise bad("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise bad("n", f"must be >= 1, got {self.n}")
        if self.temperature == 0 and self.n > 1:
            raise bad("n", f"greedy decoding (temperature 0) gives {self.n} identical samples")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.sleep_level not in (1, 2):
            raise bad("sleep_level", f"must be 1 or 2, got {self.sleep_level}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise bad("kv_cache_bytes", "must be > 0")
        if not (Path(self.model) / "config.json").is_file():
            raise bad("model", f"{self.model!r} is not a local HF model directory (no config.json)")


# Per-call overrides accepted in `generate`'s params (validation rollouts: greedy, n=1).
_SAMPLING_OVERRIDES = ("temperature", "top_p", "top_k", "max_new_tokens", "n", "seed")
_CPU_KV_CACHE_BYTES = 256 << 20


class VLLMRollout:
    """Rollout role backed by a vLLM engine in this process. Registered as ("rollout", "vllm")."""

    def __init__(self) -> None:
        self.cfg: VLLMRolloutConfig | None = None
        self.llm: Any = None
        self.on_gpu = False
        self.eos_ids: list[int] = []
        self.pad_id = 0
        self.vocab_size = 0
        self.max_model_len = 0
        self.seed = 0
        self.calls = 0  # generate calls so far: part of the default per-request seed
        self.policy_version: int | None = None
        self.weights_ok = True  # False after a failed/incomplete update
        self.asleep = False
        self._update: vllm_compat.WeightUpdate | None = None
        self._update_t0 = 0.0

    # ------------------------------------------------------------------ lifecycle

    def setup(self, ctx: StageContext) -> None:
        path = f"stages.{ctx.stage}.options"
        cfg = from_dict(VLLMRolloutConfig, dict(ctx.options), path)
        self.cfg = cfg
        self.seed = ctx.seed if cfg.seed is None else cfg.seed
        self.on_gpu = ctx.device.type == "cuda" and torch.cuda.is_available()
        hf_cfg, gen_cfg = _read_model_json(cfg.model, path)
        self.eos_ids = _eos_ids(cfg, hf_cfg, gen_cfg, path)
        self.pad_id = _pad_id(cfg, hf_cfg, gen_cfg, self.eos_ids, path)
        t0 = time.perf_counter()
        self.llm = vllm_compat.build_engine(**self._engine_kwargs(cfg))
        ctx.log.info("vllm engine for %s ready in %.1f s", cfg.model, time.perf_counter() - t0)
        self.vocab_size = vllm_compat.engine_vocab_size(self.llm)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self._update = vllm_compat.WeightUpdate(self.llm)

    def _engine_kwargs(self, cfg: VLLMRolloutConfig) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            model=cfg.model,
            skip_tokenizer_init=True,  # token ids in, token ids out
            dtype=cfg.dtype,
            seed=self.seed,
            # Sampling defaults come from our options only, never the model's
            # generation_config.json (which would silently add its EOS / top_k).
            generation_config="vllm",
            logprobs_mode="processed_logprobs",
            enforce_eager=(not self.on_gpu) if cfg.enforce_eager is None else cfg.enforce_eager,
        )
        if cfg.max_model_len is not None:
            kw["max_model_len"] = cfg.max_model_len
        if cfg.max_num_seqs is not None:
            kw["max_num_seqs"] = cfg.max_num_seqs
        if self.on_gpu:
            kw["gpu_memory_utilization"] = cfg.gpu_memory_utilization
            kw["enable_sleep_mode"] = cfg.sleep_mode
            if cfg.kv_cache_bytes is not None:
                kw["kv_cache_memory_bytes"] = cfg.kv_cache_bytes
        else:
            # On CPU vLLM reads gpu_memory_utilization as a share of host RAM to reserve
            # (0.9 by default); a fixed KV budget keeps it from taking the machine.
            kw["kv_cache_memory_bytes"] = cfg.kv_cache_bytes or _CPU_KV_CACHE_BYTES
        return kw

    def close(self) -> None:
        self.llm = None  # vLLM frees the in-process engine when its last reference goes
        self._update = None

    def state_dict(self) -> dict[str, Any]:
        # Weights belong to the actor; a resumed run reshards before its first rollout.
        return {"calls": self.calls, "policy_version": self.policy_version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = int(state.get("calls", 0))
        self.policy_version = state.get("policy_version")

    # ------------------------------------------------------------------ ops

    def handle(self, op: str, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        if self.llm is None:
            raise RuntimeError("VLLMRollout.handle before setup (or after close)")
        if op == "generate":
            return self.generate(batch, params)
        if op == "load_weights":
            version = params.get("version")
            return {}, self.load_bucket(batch, last=bool(params.get("last", True)), version=version)
        if op == "sleep":
            return {}, self.sleep()
        if op == "wake_up":
            return {}, self.wake_up(params.get("tags"))
        raise BatchError(
            f"vllm rollout: unknown op {op!r}; known: generate, load_weights, sleep, wake_up"
        )

    def generate(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        cfg = self._check_ready()
        opts = _overrides(cfg, params)
        prompt_ids, prompt_mask = batch.get("prompt_ids"), batch.get("prompt_mask")
        prompts = _prompts(prompt_ids, prompt_mask, self.vocab_size)
        longest = max(len(p) for p in prompts)
        if longest + opts["max_new_tokens"] > self.max_model_len:
            raise BatchError(
                f"vllm rollout: prompt of {longest} tokens + max_new_tokens "
                f"{opts['max_new_tokens']} exceeds max_model_len {self.max_model_len} "
                "(raise options.max_model_len or shorten prompts)"
            )
        if opts["seed"] is not None:
            base_seed = int(opts["seed"])
        elif "step" in params and "mb_id" in params:
            base_seed = _mix_seed(self.seed, params["step"], params["mb_id"])
        else:
            base_seed = _mix_seed(self.seed, "call", self.calls)
        self.calls += 1
        sampling = [
            self._sampling_params(opts, (base_seed + i) % (1 << 63)) for i in range(len(prompts))
        ]
        t0 = time.perf_counter()
        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False
        )
        gen_s = time.perf_counter() - t0
        result = _pack(outs, opts["n"], self.pad_id)
        assert prompt_ids is not None and prompt_mask is not None  # checked by _prompts
        n = opts["n"]
        result["prompt_ids"] = prompt_ids.repeat_interleave(n, dim=0)
        result["prompt_mask"] = prompt_mask.repeat_interleave(n, dim=0)
        tokens = int(result["response_mask"].sum())
        metrics = {
            "rollout/gen_s": gen_s,
            "rollout/tokens": float(tokens),
            "rollout/tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
            "rollout/response_len_mean": tokens / max(1, result["response_mask"].shape[0]),
        }
        if self.policy_version is not None:
            metrics["rollout/policy_version"] = float(self.policy_version)
        return result, metrics

    def _sampling_params(self, opts: dict[str, Any], seed: int) -> Any:
        from vllm import SamplingParams

        greedy = opts["temperature"] == 0
        return SamplingParams(
            n=opts["n"],
            temperature=opts["temperature"],
            top_p=1.0 if greedy else opts["top_p"],
            top_k=0 if greedy else opts["top_k"],
            max_tokens=opts["max_new_tokens"],
            seed=None if greedy else seed,
            stop_token_ids=list(self.eos_ids) if self.cfg and self.cfg.stop_on_eos else None,
            ignore_eos=not (self.cfg and self.cfg.stop_on_eos),
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
        )

    def _check_ready(self) -> VLLMRolloutConfig:
        assert self.cfg is not None and self._update is not None
        if self._update.active:
            raise BatchError(
                "vllm rollout: generate during a weight update (load_weights buckets sent "
                "without the `last` one)"
            )
        if not self.weights_ok:
            raise vllm_compat.WeightSyncError(
                "vllm rollout: the last weight update failed or was incomplete; the engine "
                "holds mixed weights and will not generate until a complete update succeeds"
            )
        if self.asleep:
            raise BatchError("vllm rollout: generate while asleep; call wake_up first")
        return self.cfg

    # ------------------------------------------------------------------ weights

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> Metrics:
        """In-process handoff (colocated actor): stream (checkpoint name, tensor) pairs into
        the engine as one complete update. The iterable is consumed lazily, so a generator
        that gathers one parameter (or one bucket) at a time bounds the extra memory."""
        self._begin()
        self._feed(weights)
        return self._end(version)

    def load_bucket(
        self, bucket: Mapping[str, torch.Tensor], *, last: bool, version: int | None = None
    ) -> Metrics:
        """One bucket of a streamed update (disaggregated: buckets arrive as messages)."""
        assert self._update is not None
        if not isinstance(bucket, Mapping):
            raise BatchError(f"load_weights: bucket must be a mapping, got {type(bucket).__name__}")
        if not self._update.active:
            self._begin()
        self._feed(bucket.items())
        if not last:
            return {"reshard/bucket_tensors": float(len(bucket))}
        return self._end(version)

    def _begin(self) -> None:
        assert self._update is not None
        if self.asleep and self.on_gpu:
            vllm_compat.wake_up(self.llm, ["weights"])  # weights back before writing them
        self.weights_ok = False  # until this update completes
        self._update_t0 = time.perf_counter()
        self._update.start()

    def _feed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        assert self._update is not None
        self._update.feed(weights)  # aborts the update itself on error

    def _end(self, version: int | None) -> Metrics:
        assert self._update is not None
        self._update.finish()  # raises WeightSyncError if incomplete
        self.weights_ok = True
        vllm_compat.reset_prefix_cache(self.llm)  # cached KV was computed with old weights
        if version is not None:
            self.policy_version = int(version)
        seconds = time.perf_counter() - self._update_t0
        return {
            "timing/reshard": seconds,
            "reshard/bytes": float(self._update.bytes),
            "reshard/tensors": float(self._update.tensors),
        }

    # ------------------------------------------------------------------ memory (GPU)

    def sleep(self) -> Metrics:
        """Before training (colocated): free KV cache (and offload/discard weights)."""
        assert self.cfg is not None
        if not (self.on_gpu and self.cfg.sleep_mode):
            return {"rollout/sleep_skipped": 1.0}
        vllm_compat.sleep(self.llm, self.cfg.sleep_level)
        self.asleep = True
        return {"rollout/sleep_skipped": 0.0}

    def wake_up(self, tags: list[str] | None = None) -> Metrics:
        """After reshard (colocated): reallocate what `sleep` freed (None = everything)."""
        if not self.asleep:
            return {"rollout/wake_skipped": 1.0}
        vllm_compat.wake_up(self.llm, tags)
        if tags is None or set(tags) >= {"weights", "kv_cache"}:
            self.asleep = False
        return {"rollout/wake_skipped": 0.0}


# ---------------------------------------------------------------------- helpers


def _read_model_json(model: str, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.json and (optional) generation_config.json of a local model dir, as JSON only."""
    out = []
    for name in ("config.json", "generation_config.json"):
        f = Path(model) / name
        if not f.is_file():
            out.append({})
            continue
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}.model", f"cannot read {f}: {exc}") from exc
        out.append(data if isinstance(data, dict) else {})
    return out[0], out[1]


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _eos_ids(
    cfg: VLLMRolloutConfig, hf: dict[str, Any], gen: dict[str, Any], path: str
) -> list[int]:
    if cfg.eos_token_id is not None:
        return [cfg.eos_token_id]
    ids = _ids(gen.get("eos_token_id")) or _ids(hf.get("eos_token_id"))
    if cfg.stop_on_eos and not ids:
        raise ConfigError(
            f"{path}.eos_token_id",
            f"the model in {cfg.model} names no EOS token; set eos_token_id or stop_on_eos: false",
        )
    return ids


def _pad_id(
    cfg: VLLMRolloutConfig, hf: dict[str, Any], gen: dict[str, Any], eos: list[int], path: str
) -> int:
    if cfg.pad_token_id is not None:
        return cfg.pad_token_id
    for source in (gen.get("pad_token_id"), hf.get("pad_token_id")):
        if isinstance(source, int):
            return source
    if eos:
        return eos[0]
    raise ConfigError(f"{path}.pad_token_id", "the model names no pad or EOS token; set it")


def _overrides(cfg: VLLMRolloutConfig, params: Params) -> dict[str, Any]:
    """The sampling options of one generate call: the config's, overridden by params."""
    given = {k: params[k] for k in _SAMPLING_OVERRIDES if params.get(k) is not None}
    seed = given.pop("seed", None)
    merged = replace(cfg, **given)
    try:
        merged.validate("params")
    except ConfigError as exc:
        raise BatchError(f"vllm rollout: bad generate params: {exc}") from exc
    opts = {k: getattr(merged, k) for k in _SAMPLING_OVERRIDES if k != "seed"}
    opts["seed"] = seed
    return opts


def _mix_seed(*parts: Any) -> int:
    """A stable 63-bit seed from (stage seed, step, mb_id, ...): same inputs, same samples."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _prompts(
    prompt_ids: torch.Tensor | None, prompt_mask: torch.Tensor | None, vocab_size: int
) -> list[list[int]]:
    """Left-padded [B, P] ids + mask -> B token lists. Raises BatchError on malformed input."""
    if prompt_ids is None or prompt_mask is None:
        missing = [
            k for k, v in (("prompt_ids", prompt_ids), ("prompt_mask", prompt_mask)) if v is None
        ]
        raise BatchError(f"vllm rollout generate: batch lacks {missing}")
    if prompt_ids.dim() != 2 or prompt_ids.shape != prompt_mask.shape:
        raise BatchError(
            f"vllm rollout generate: prompt_ids {tuple(prompt_ids.shape)} and prompt_mask "
            f"{tuple(prompt_mask.shape)} must both be [B, P]"
        )
    if prompt_ids.dtype.is_floating_point or prompt_ids.dtype == torch.bool:
        raise BatchError(
            f"vllm rollout generate: prompt_ids must be integer, got {prompt_ids.dtype}"
        )
    if prompt_ids.shape[0] == 0:
        raise BatchError("vllm rollout generate: empty batch (B = 0)")
    mask = prompt_mask.to(torch.int64)
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise BatchError("vllm rollout generate: prompt_mask must hold only 0 and 1")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        rows = torch.nonzero((mask[:, 1:] < mask[:, :-1]).any(dim=1)).flatten().tolist()
        raise BatchError(
            f"vllm rollout generate: prompts must be left-padded (mask 0..0 1..1); rows {rows[:8]} are not"
        )
    lengths = mask.sum(dim=1)
    if bool((lengths == 0).any()):
        rows = torch.nonzero(lengths == 0).flatten().tolist()
        raise BatchError(f"vllm rollout generate: rows {rows[:8]} have an empty prompt")
    ids = prompt_ids.to(torch.int64)
    valid = ids[mask.bool()]
    if bool(((valid < 0) | (valid >= vocab_size)).any()):
        bad = valid[(valid < 0) | (valid >= vocab_size)][:8].tolist()
        raise BatchError(
            f"vllm rollout generate: prompt token ids {bad} outside the model's vocabulary [0, {vocab_size})"
        )
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

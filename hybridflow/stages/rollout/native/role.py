"""The `native` rollout backend: the role that puts the native engine behind the rollout
contract of the `hf` and `vllm` backends (rollout/hf.py's docstring: the same batch
fields, shapes, log-prob semantics and metrics).

Ops (declared with stages/contract.py's `@op`; `RoleBase.handle` runs them synchronously):

  generate      concurrent (async): prompt_ids/prompt_mask [B, P] -> prompt_ids, prompt_mask,
                response_ids, response_mask, rollout_logprobs [B*n, ...], group_index [B*n].
                Several calls may be in flight at once: their rows share decode steps
                (continuous batching), and each returns as soon as its own rows are done.
                With `env` (multi-turn, rollout/multiturn.py): one trajectory per row, run
                continuously (each trajectory's next turn joins the running decode batch
                when its environment step returns); each turn is a session request, so
                the engine prefills only the turn's new tokens on top of the trajectory's
                parked K/V. A whole trajectory must fit one slot (max_prompt_len +
                max_new_tokens positions). + env_reward [B*n], num_turns [B*n].
  load_weights  step op: one streamed bucket {name: tensor}; params {"last", "version"}
  sleep         step op: frees the KV cache and CUDA graphs (`release_cache_on_sleep`)
  wake_up       step op: re-allocates them (and re-captures the graphs)
Not an op: `update_weights(iterable of (name, tensor), version)`, the in-process hand-off
of a colocated actor (actor.reshard calls it); `hold_adapters(lora, seed)`, called by the
stage host after setup when a LoRA actor syncs adapters only (rollout/adapters.py).

Randomness: each call's seed is `params["seed"]`, else mix_seed(seed, step, mb_id), else
mix_seed(seed, "call", counter), as in the hf backend; the samples of a call depend on that
seed only, not on the other calls it shares the engine with.

Invariants: generation never runs on a partially written model; weight updates, sleep and
wake-up are refused while any generate call is in flight (the runtime reshards between
phases); all device work runs on the engine's thread; outputs are CPU tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hybridflow.config.loader import from_dict
from hybridflow.errors import ConfigError
from hybridflow.stages.base import Batch, Metrics, Params, StageContext
from hybridflow.stages.common import build_model, mix_seed, options_path, require
from hybridflow.stages.contract import RoleBase, Scope, op
from hybridflow.stages.rollout.adapters import AdapterWeights, hold
from hybridflow.stages.rollout.multiturn import (
    TrajectoryLoop,
    TurnOutput,
    TurnRequest,
    trajectory_loop,
    trajectory_records,
)
from hybridflow.stages.rollout.native import limits
from hybridflow.stages.rollout.native.engine import EngineConfig, NativeEngine
from hybridflow.stages.rollout.native.frontend import AsyncEngine, EngineClosedError
from hybridflow.stages.rollout.native.request import Request, SamplingParams
from hybridflow.stages.rollout.native.submit import TickBatcher
from hybridflow.stages.rollout.state import (
    GENERATE_INPUTS,
    GENERATE_OUTPUTS,
    GENERATE_PARAMS,
    HFRolloutOptions,
    RolloutState,
    check_prompts,
    eos_ids,
)
from hybridflow.stages.rollout.weights import InPlaceWeights

GIB = float(1 << 30)


@dataclass
class NativeRolloutOptions(HFRolloutOptions):
    # A KV slot holds max_prompt_len + max_new_tokens positions; longer prompts are refused.
    # None: min(512, the model's positions - max_new_tokens) (limits.py)
    max_prompt_len: int | None = None
    kv_cache_gb: float = 4.0  # KV cache budget; slots = min(max_num_seqs, budget // slot)
    # 0: slot KV (a sequence reserves max_prompt_len + max_new_tokens positions); > 0 (a
    # multiple of 16): paged KV in blocks of this many positions, memory following the
    # lengths rows reach, a prompt's n samples sharing its blocks, rows preempted and
    # recomputed when blocks run out (native/paged.py); on CUDA its attention is a Triton
    # kernel reading only live blocks
    kv_block_size: int = 0
    # paged KV: the n samples of a prompt read its shared prompt blocks once per decode
    # step (cascade attention: one pass per prompt group, one per row over its own
    # blocks, merged by log-sum-exp; native/forward/shared_prefix.py), in the steps where
    # that saves enough reads (long shared prompts: shared_prefix.PREFIX_MIN_SAVED says
    # where it pays); false: never
    shared_prefix_attention: bool = True
    max_num_seqs: int = 256  # most sequences decoded together
    cuda_graphs: bool = True  # CUDA-graph decode steps (GPU only; CPU always runs eager)
    # Queue each decode step before reading which rows the last one finished, so the GPU
    # need not wait on the host between steps (native/engine.py "Lookahead"). null: on a
    # GPU (an H100, session 16: lockstep's tokens; decode 141.4k -> 146.0k tok/s), off on
    # the CPU, where the host is the device and nothing overlaps
    decode_lookahead: bool | None = None
    # Decode in few kernels (native/forward/fused.py): merged q/k/v and gate/up projections (the
    # modules' weights become views of them, rebuilt at every weight update), one
    # attention mask per step. Models it cannot take keep the module path.
    fused_decode: bool = True
    # ... and its norm, RoPE and SiLU parts (and the sampler's per-row uniforms) through
    # torch.compile: CUDA only; the engine's first allocation compiles them (~4-10 s on an
    # H200); a compile that fails falls back to eager with a warning. Measured on an H200
    # (bench/RESULTS.md): Qwen2-0.5B, 152k vocab, 256 rows 51.2k -> 79.1k tok/s
    compile_decode: bool = True
    # ... and Triton kernels for the q/k/v epilogue with its K/V writes (one per layer) and
    # for an untruncated sampling step (CUDA; request.EngineConfig says more). Measured
    # on an H100 (bench/RESULTS.md session 16): Qwen2-0.5B, 256 rows, 94.4k -> 141.4k tok/s
    decode_kernels: bool = True
    graph_batch_sizes: list[int] = field(default_factory=list)  # [] = default buckets
    # attention lengths of decode steps ([] = 64, 128, ... up to the slot's; one value
    # >= max_prompt_len + max_new_tokens makes every step read whole slots)
    decode_lengths: list[int] = field(default_factory=list)
    # prompts x longest prompt per prefill batch (an admission step's activations). 16384
    # rather than 8192: a multi-turn boundary of 256 trajectories extends each by its
    # observation + 1 token (~33 in bench/multiturn.py), 8448 positions, so 8192 split every
    # boundary into two admission steps, each paying the eager forward's fixed host cost;
    # the activations of 16384 positions are ~160 MB for Qwen2-0.5B's MLP in bf16.
    max_prefill_tokens: int = 16384
    release_cache_on_sleep: bool = True  # sleep frees the KV cache (colocated training)
    alias_weights: bool = False  # share the actor's tensors when dtype/device match
    # multi-turn: keep a trajectory's K/V between its turns (False: re-prefill each turn)
    reuse_kv: bool = True
    # multi-turn: with nothing decoding, admit a turn boundary's arriving requests together
    # once none has arrived for this long (at most 20 ms; 0: admit as they come). Off by
    # default: it measured no faster on the CPU machine, and slower on an H200 at 2 ms
    # (bench/RESULTS.md); the loop-side burst below does this job.
    admission_gather_ms: float = 0.0
    # multi-turn: a turn boundary's burst of requests waits for the trajectories still in
    # an environment or tool call until none has come back for this long (at most 10x it
    # in all; submit.py): a slow environment delays the others' next turns by about this
    burst_hold_ms: float = 20.0
    # Benchmark knob (0 = off): each row stops at a length drawn from a log-normal of this
    # median and `forced_length_sigma`, capped at max_new_tokens, as if it emitted EOS
    # there. A random-init model never stops, so this is how a benchmark gets the length
    # mix of real RL responses (most short, a long tail up to the cap); the draw depends
    # on the call's seed only. Single-turn only.
    forced_length_median: int = 0
    forced_length_sigma: float = 0.75  # the log-normal's sigma (of ln length)

    def validate(self, path: str) -> None:
        HFRolloutOptions.validate(self, path)

        def bad(key: str, msg: str) -> ConfigError:
            return ConfigError(f"{path}.{key}" if path else key, msg)

        if self.max_prompt_len is not None and self.max_prompt_len < 1:
            raise bad("max_prompt_len", f"must be >= 1 (or unset), got {self.max_prompt_len}")
        if self.kv_cache_gb <= 0:
            raise bad("kv_cache_gb", f"must be > 0, got {self.kv_cache_gb}")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.kv_block_size < 0 or self.kv_block_size % 16:
            raise bad("kv_block_size", f"must be 0 or a multiple of 16, got {self.kv_block_size}")
        if any(b < 1 for b in self.graph_batch_sizes):
            raise bad("graph_batch_sizes", f"must all be >= 1, got {self.graph_batch_sizes}")
        if any(n < 1 for n in self.decode_lengths):
            raise bad("decode_lengths", f"must all be >= 1, got {self.decode_lengths}")
        if self.max_prefill_tokens < 1:
            raise bad("max_prefill_tokens", f"must be >= 1, got {self.max_prefill_tokens}")
        if self.admission_gather_ms < 0:
            raise bad("admission_gather_ms", f"must be >= 0, got {self.admission_gather_ms}")
        if self.burst_hold_ms < 0:
            raise bad("burst_hold_ms", f"must be >= 0, got {self.burst_hold_ms}")
        if self.forced_length_median < 0:
            raise bad("forced_length_median", f"must be >= 0, got {self.forced_length_median}")
        if self.forced_length_sigma < 0:
            raise bad("forced_length_sigma", f"must be >= 0, got {self.forced_length_sigma}")
        if self.forced_length_median and self.env:
            raise bad("forced_length_median", "applies to single-turn rollouts; unset `env`")

    def check_plan(self, path: str) -> None:
        """At plan time (`hybridflow validate`): these options against the model's config,
        read without building the model (limits.py)."""
        limits.check(self, limits.model_facts(self, path), path)


class NativeRollout(RolloutState, RoleBase):
    """Registered as ("rollout", "native")."""

    backend_name = "native"
    options_cls = NativeRolloutOptions
    runs_environments = True
    takes_adapters = True

    def __init__(self) -> None:
        self.opts: NativeRolloutOptions | None = None
        self.engine: AsyncEngine | None = None
        self.weights: InPlaceWeights | None = None
        self.calls = 0
        self.policy_version: int | None = None
        self._active = 0  # generate calls in flight (all on the stage's event loop)
        self.loop: TrajectoryLoop | None = None
        self._calls = itertools.count()  # one per multi-turn call: its sessions' namespace

    # -- lifecycle -----------------------------------------------------------------------
    def setup(self, ctx: StageContext) -> None:
        path = self._path = options_path(ctx)
        opts = from_dict(NativeRolloutOptions, dict(ctx.options), path)
        self.opts = opts
        self.device = ctx.device
        self.seed = ctx.seed if opts.seed is None else opts.seed
        self.tokenizer, model = build_model(ctx, opts, "causal_lm")
        model.requires_grad_(False)
        self.pad_id = (
            opts.pad_token_id if opts.pad_token_id is not None else self.tokenizer.pad_token_id
        )
        self.eos_ids = eos_ids(
            opts.eos_token_id,
            self.tokenizer.eos_token_id,
            getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        )
        self.vocab_size = int(model.config.vocab_size)
        if opts.stop_on_eos and not self.eos_ids:
            raise ConfigError(f"{path}.eos_token_id", "the model names no EOS token")
        # The plan's checks again, on the built model's config (a directory may have changed)
        self.max_prompt_len = limits.check(opts, limits.ModelFacts.of(model.config), path)
        max_len = self.max_prompt_len + opts.max_new_tokens
        config = EngineConfig(
            max_model_len=max_len,
            kv_cache_gb=opts.kv_cache_gb,
            max_num_seqs=opts.max_num_seqs,
            cuda_graphs=opts.cuda_graphs,
            graph_batch_sizes=tuple(opts.graph_batch_sizes),
            decode_lengths=tuple(opts.decode_lengths),
            max_prefill_tokens=opts.max_prefill_tokens,
            max_stop_ids=max(1, len(self.eos_ids)),
            autocast_bf16=opts.autocast_bf16,
            keep_sessions=opts.reuse_kv,
            fused_decode=opts.fused_decode,
            compile_decode=opts.compile_decode,
            kv_block_size=opts.kv_block_size,
            shared_prefix=opts.shared_prefix_attention,
            lookahead=(
                ctx.device.type == "cuda"
                if opts.decode_lookahead is None
                else opts.decode_lookahead
            ),
            rope_kernel=opts.decode_kernels,
            sample_kernel=opts.decode_kernels,
        )
        self.loop = trajectory_loop(ctx, opts, self.tokenizer, self.eos_ids, max_len)
        # CPU single-turn: the engine steps in the worker thread (frontend.py "Driven"); a
        # trajectory loop submits from a thread of its own, and a GPU wants the host free.
        driven = ctx.device.type == "cpu" and self.loop is None and ctx.compute is not None
        self.engine = AsyncEngine(
            NativeEngine(model, config, path=path), driver=ctx.compute if driven else None
        )
        self.weights = InPlaceWeights(
            dict(model.named_parameters(remove_duplicate=False)), alias=opts.alias_weights
        )
        if self.loop is not None:
            # Two busy threads from here on: the engine's, launching kernels, and the
            # trajectory loop's, turning 100s of finished turns into next requests at every
            # turn boundary. Each time the engine thread gives up the GIL (a copy, a wait)
            # it may wait up to the switch interval to get it back: 5 ms by default, 0.5
            # here. An H200 (bench/multiturn.py, bench/RESULTS.md): 26.5k model tok/s at
            # 5 ms (6.9 ms per decode step), 30.2k at 0.5 ms (6.1; single turn: 5.9).
            sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
            assert self.engine is not None
            self.engine.gather_s = opts.admission_gather_ms / 1000

    def hold_adapters(self, lora: Mapping[str, Any], seed: int) -> None:
        """Hold a LoRA actor's adapters unmerged (rollout/adapters.py), on the engine
        thread: the engine's forwards call the wrapped modules from now on."""
        assert self.opts is not None
        alias = self.opts.alias_weights

        def wrap(core: NativeEngine) -> AdapterWeights:
            model = core.model.hf
            core.model.unfuse()  # the merged weights would skip the adapters
            hold(model, lora, seed=seed, path=self._path)
            core.model.lm_head = model.lm_head  # a targeted head is peft's layer now
            core.refresh_graphs()  # captured over the unwrapped modules
            return AdapterWeights(model, alias=alias)

        self.weights = self._engine().call(wrap)

    def close(self) -> None:
        if self.loop is not None:
            self.loop.close()
            self.loop = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def _engine(self) -> AsyncEngine:
        if self.engine is None or self.weights is None:
            raise RuntimeError("NativeRollout used before setup (or after close)")
        return self.engine

    # -- ops -----------------------------------------------------------------------------
    @op(inputs=GENERATE_INPUTS, outputs=GENERATE_OUTPUTS, params=GENERATE_PARAMS, concurrent=True)
    async def generate(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """Sample n responses per prompt; awaits the engine thread (other calls' rows
        share its decode steps meanwhile)."""
        engine = self._engine()
        assert self.weights is not None
        opts = self._call_options(params)
        where = "native rollout generate"
        self.weights.ready(where)
        require(batch, ("prompt_ids", "prompt_mask"), where)
        ids, mask = batch["prompt_ids"], batch["prompt_mask"]
        m = check_prompts(ids, mask, where, self.vocab_size)
        seed = self._call_seed(params)
        prompts = [ids[i][m[i].bool()].to(torch.int64) for i in range(ids.shape[0])]
        sampling = SamplingParams(
            temperature=opts.temperature,
            top_p=opts.top_p,
            top_k=opts.top_k,
            max_new_tokens=opts.max_new_tokens,
            n=opts.n,
            stop_token_ids=tuple(self.eos_ids) if opts.stop_on_eos else (),
        )
        if self.loop is not None:
            return await self._generate_trajectories(batch, prompts, m, sampling, seed, opts.n)
        t0 = time.perf_counter()
        # Calls of this op run side by side on the stage's event loop (one thread), so a
        # plain counter says how many micro-batches shared the engine with this one.
        self._active += 1
        shared = self._active
        try:
            caps = forced_lengths(opts, len(prompts) * opts.n, seed)
            out = await engine.generate(Request(prompts, sampling, seed, max_new_tokens=caps))
        finally:
            self._active -= 1
        gen_s = time.perf_counter() - t0
        width = out.tokens.shape[1]
        response_mask = (torch.arange(width)[None, :] < out.lengths[:, None]).to(torch.int64)
        result = {
            "prompt_ids": ids.repeat_interleave(opts.n, dim=0),  # [B*n, P]
            "prompt_mask": m.repeat_interleave(opts.n, dim=0),  # [B*n, P]
            "response_ids": torch.where(response_mask.bool(), out.tokens, self.pad_id),
            "response_mask": response_mask,  # [B*n, R]
            "rollout_logprobs": out.logprobs * response_mask,  # [B*n, R] float32
            "group_index": torch.arange(ids.shape[0]).repeat_interleave(opts.n),  # [B*n]
        }
        tokens = int(out.lengths.sum())
        metrics = self._generate_metrics(gen_s, tokens, int(out.lengths.numel()))
        metrics["rollout/concurrent_calls"] = float(shared)  # this call and those in flight
        if self.device.type == "cuda":  # the process's peak (colocated actor included)
            metrics["rollout/peak_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / GIB
        return result, metrics

    async def _generate_trajectories(
        self,
        batch: Batch,
        prompts: list[torch.Tensor],  # B prompts, each [P_i]
        mask: torch.Tensor,  # [B, P]
        sampling: SamplingParams,
        seed: int,
        n: int,
    ) -> tuple[Batch, Metrics]:
        """`generate` with an environment: one trajectory per row (module docstring)."""
        assert self.loop is not None and self.engine is not None and self.opts is not None
        records = trajectory_records(batch, n, "native rollout generate")
        rows = [p.tolist() for p in prompts for _ in range(n)]  # row i*n+j: prompt i
        turns = _NativeTurns(
            TickBatcher(self.engine, self.opts.burst_hold_ms / 1000),
            replace(sampling, n=1),
            seed,
            next(self._calls),
        )
        t0 = time.perf_counter()
        self._active += 1
        try:
            result = await self.loop.run(turns, rows, records, sampling.max_new_tokens)
        finally:
            self._active -= 1
        wall_s = time.perf_counter() - t0
        out = result.tensors(self.pad_id)
        out.setdefault("prompt_ids", batch["prompt_ids"].repeat_interleave(n, dim=0))
        out.setdefault("prompt_mask", mask.repeat_interleave(n, dim=0))
        out["group_index"] = torch.arange(len(prompts)).repeat_interleave(n)  # [B*n]
        tokens = int(out["response_mask"].sum())  # model tokens (observations excluded)
        # The loop's wall time is the rollout's: engine and environments overlap in it.
        metrics = self._generate_metrics(wall_s, tokens, len(rows))
        context = result.metrics["rollout/context_tokens"]
        metrics["rollout/reused_tokens"] = float(turns.reused)
        metrics["rollout/prefill_saved_frac"] = turns.reused / context if context else 0.0
        return out, {**metrics, **result.metrics}

    @op(scope=Scope.STEP)
    def sleep(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """Free the KV cache and CUDA graphs (if `release_cache_on_sleep`)."""
        assert self.opts is not None
        if not self.opts.release_cache_on_sleep:
            return {}, {"rollout/sleep_skipped": 1.0}
        engine = self._engine()
        t0 = time.perf_counter()
        freed = engine.call(lambda core: core.release())
        return {}, {"rollout/sleep_s": time.perf_counter() - t0, "rollout/kv_freed_gb": freed / GIB}

    @op(scope=Scope.STEP)
    def wake_up(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """Re-allocate the KV cache and re-capture the graphs (no-op when awake)."""
        engine = self._engine()
        t0 = time.perf_counter()

        def wake(core: NativeEngine) -> dict[str, float]:
            core.allocate()
            return core.memory_stats()

        stats = engine.call(wake)
        metrics = {"rollout/wake_s": time.perf_counter() - t0}
        metrics["rollout/kv_cache_gb"] = stats["kv_cache_bytes"] / GIB
        if "peak_allocated_bytes" in stats:
            metrics["rollout/peak_mem_gb"] = stats["peak_allocated_bytes"] / GIB
        return {}, metrics

    # -- weights: RolloutState's protocol, each call on the engine thread ---------------
    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> Metrics:
        """In-process hand-off (colocated actor): one complete update, consumed lazily on
        the engine thread; refused while a generate call is in flight."""
        engine = self._engine()
        assert self.weights is not None
        receiver = self.weights
        return engine.call(lambda core: self._finish(core, receiver.update(weights), version))

    def load_bucket(
        self, bucket: Mapping[str, torch.Tensor], *, last: bool, version: int | None = None
    ) -> Metrics:
        """One bucket of a streamed update (disaggregated: buckets arrive as messages)."""
        engine = self._engine()
        assert self.weights is not None
        receiver = self.weights

        def apply(core: NativeEngine) -> Metrics:
            metrics = receiver.bucket(bucket, last=last)
            return self._finish(core, metrics, version) if last else metrics

        return engine.call(apply)

    def _finish(self, core: NativeEngine, metrics: Metrics, version: int | None) -> Metrics:
        assert self.weights is not None
        # Aliased storage: the fused decode's merged weights take the new values, and the
        # graphs (which point at the old tensors where they read the modules) re-capture.
        core.model.refresh_fused()
        if self.weights.replaced:
            core.refresh_graphs()
        return self._updated(metrics, version)


class _NativeTurns:
    """The native engine as the trajectory loop's turn engine (multiturn.TurnEngine):
    continuous (each request is its own engine request, seeded by (call seed, row,
    turn), batched with whatever else runs), and each trajectory a session, so the engine
    keeps its K/V between turns and `end` frees it."""

    continuous = True

    def __init__(self, engine: TickBatcher, sampling: SamplingParams, seed: int, call: int):
        self.engine = engine  # a turn boundary reaches the engine as one burst
        self.sampling, self.seed, self.call = sampling, seed, call
        self.stop = set(sampling.stop_token_ids)
        self.reused = 0  # context positions the engine took from parked K/V

    async def generate(self, requests: Sequence[TurnRequest], turn: int) -> list[TurnOutput]:
        outs = await asyncio.gather(
            *(
                self.engine.generate(
                    Request(
                        [torch.tensor(q.context_ids, dtype=torch.int64)],
                        replace(self.sampling, max_new_tokens=q.max_new_tokens),
                        seed=mix_seed(self.seed, "turn", q.key, turn),
                        session=(self.call, q.key),
                    )
                )
                for q in requests
            )
        )
        result = []
        for o in outs:
            k = int(o.lengths[0])
            ids = o.tokens[0, :k].tolist()
            result.append(
                TurnOutput(ids, o.logprobs[0, :k].tolist(), bool(ids) and ids[-1] in self.stop)
            )
            self.reused += o.reused_tokens
        return result

    def end(self, keys: Sequence[int]) -> None:
        with contextlib.suppress(EngineClosedError):  # closing: it frees everything itself
            self.engine.drop_sessions([(self.call, k) for k in keys])


def forced_lengths(opts: NativeRolloutOptions, rows: int, seed: int) -> list[int] | None:
    """Per-row length caps of `forced_length_median` (None when off): log-normal draws
    from `seed`, in 1..max_new_tokens."""
    if not opts.forced_length_median:
        return None
    return lognormal_lengths(
        opts.forced_length_median, opts.forced_length_sigma, opts.max_new_tokens, rows, seed
    )


def lognormal_lengths(median: int, sigma: float, cap: int, rows: int, seed: int) -> list[int]:
    """`rows` lengths from a log-normal of `median` and `sigma` (of ln length), seeded,
    in 1..cap: most short, a long tail up to the cap (the mix of real RL responses)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, generator=g, dtype=torch.float64)
    lengths = (median * torch.exp(sigma * z)).round()
    return lengths.clamp(1, cap).to(torch.int64).tolist()

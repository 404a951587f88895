"""The `hf` rollout backend: batched sampling with a transformers causal LM and a KV cache.

Same contract as the `vllm` backend (rollout_vllm.py), so the two are interchangeable:

  generate      prompt_ids   # [B, P] int, left-padded
                prompt_mask  # [B, P] 0/1
            ->  prompt_ids       # [B*n, P]  each prompt repeated n times (row i*n+j: sample j of prompt i)
                prompt_mask      # [B*n, P]
                response_ids     # [B*n, R]  int64, right-padded with pad_token_id, R = longest response
                response_mask    # [B*n, R]  int64 0/1; the EOS that stopped a sample is part of it
                rollout_logprobs # [B*n, R]  float32, see below (0 at padding)
                group_index      # [B*n]     int64, the prompt row (0..B-1) each sample answers
                params (optional overrides): temperature, top_p, top_k, max_new_tokens, n, seed
  load_weights  batch = one bucket {parameter name: tensor}; params {"last": bool = True,
                "version": int}. After the last bucket the update is checked for
                completeness (every parameter written once or more).
  sleep/wake_up no-ops here (metrics rollout/sleep_skipped, rollout/wake_skipped = 1), so
                presets written for the vllm backend run unchanged.

In-process hand-off from a colocated actor: `update_weights(iterable of (name, tensor), version)`.
A LoRA actor with `lora_sync: adapters`: the stage host calls `hold_adapters(lora, seed)`
after setup, and the model then holds the adapters unmerged (rollout/adapters.py).

Multi-turn (options `env`, ...; state.py): `generate` runs the trajectory loop
(multiturn.py) with this backend's sampler as its turn engine (`_HFTurns`: each turn
re-prefills every live trajectory's whole context, left-padded, with a per-row token
limit). It needs `metadata_json` among its inputs (each row's record, for the
environment's reset) and returns the same fields, laid out by stages/env/layout.collate
(response_mask 0 on observation tokens), plus `env_reward` [B] float32 and `num_turns`
[B] int64. Turn k samples from a generator seeded from (the call's seed, k).

Sampling log-probs (`rollout_logprobs`): the log-probability of each sampled token under the
distribution it was actually drawn from: softmax(logits / temperature), restricted to the
top-k tokens and then to the top-p nucleus (smallest prefix of the sorted distribution
whose mass reaches top_p; ties at the k-th logit are kept), renormalised over the kept
tokens. Without top-k/top-p this equals the actor's recomputation
`log_softmax(logits / temperature)[token]` (tests check it); with truncation it is >= that.
Greedy decoding (temperature 0) reports log-probs at temperature 1, as the vllm backend does.

Randomness: each call samples from its own generator seeded from (seed, step, mb_id) when
the runtime passes them (it does, as reserved params), else from (seed, call counter). So a
micro-batch's samples do not depend on which replica ran it or what ran before; the
replica index is deliberately not part of the seed.

Batching across micro-batches: `generate` is a concurrent op. It checks a call on the
stage's loop (where seeds are drawn), then hands it to a CallMerger (rollout/merge.py),
which runs it in the stage's worker thread. On the CPU by default (`merge_gangs`; on a
GPU when set, memory permitting) the micro-batches the coordinator sent together (a gang:
one op and step, this replica, one scheduling round; Task params `mb_gang`) decode as one
forward loop, in mb_id order: a function of the schedule, so runs and resumes stay
bit-identical. Opt-in, `merge_window_ms` > 0
merges whatever arrives within that window or queues behind a running call instead (not
bit-reproducible: arrival times decide who shares a loop). Either way each call's rows
draw from the call's own generator, so its samples are those of running it alone, up to
float rounding of the wider batch, and each call gets back its own rows, cut to its own
longest response. Multi-turn calls run alone. Measured on the 2-core CPU machine, GRPO
with 2 micro-batches of 32: merged, the rollout phase went from 0.42-0.47 s to
0.29-0.36 s (bench/RESULTS.md).

Invariants: generation never runs on a partially written model (an update in progress or
one that failed makes `generate` raise until a complete update succeeds); the model is
never trained here (no grad); outputs are CPU tensors.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from hybridflow.config.loader import from_dict
from hybridflow.data.batching import pad_left, unpad
from hybridflow.errors import BatchError, ConfigError
from hybridflow.stages.base import Batch, Metrics, Params, StageContext
from hybridflow.stages.common import (
    build_model,
    mix_seed,
    options_path,
    require,
    row_chunks,
)
from hybridflow.stages.contract import RoleBase, Scope, op
from hybridflow.stages.rollout.adapters import AdapterWeights, hold
from hybridflow.stages.rollout.merge import CallMerger
from hybridflow.stages.rollout.multiturn import (
    TrajectoryLoop,
    TurnOutput,
    TurnRequest,
    trajectory_loop,
    trajectory_records,
)
from hybridflow.stages.rollout.state import (
    GENERATE_INPUTS,
    GENERATE_OUTPUTS,
    GENERATE_PARAMS,
    SAMPLING_OVERRIDES,
    HFRolloutOptions,
    RolloutState,
    check_prompts,
    eos_ids,
)
from hybridflow.stages.rollout.weights import InPlaceWeights
from hybridflow.transport import aio


class HFRollout(RolloutState, RoleBase):
    """Registered as ("rollout", "hf")."""

    backend_name = "hf"
    runs_environments = True
    takes_adapters = True

    options_cls = HFRolloutOptions  # checked at plan time too (pipeline/plan/planner.py)

    def __init__(self) -> None:
        self.opts: HFRolloutOptions | None = None
        self.model: Any = None
        self.calls = 0
        self.policy_version: int | None = None
        self.weights: InPlaceWeights | None = None
        self.loop: TrajectoryLoop | None = None
        self.merger: CallMerger[_Call, tuple[Batch, Metrics]] | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def setup(self, ctx: StageContext) -> None:
        opts = from_dict(HFRolloutOptions, dict(ctx.options), options_path(ctx))
        self.opts = opts
        self.device = ctx.device
        self._path = options_path(ctx)
        self.seed = ctx.seed if opts.seed is None else opts.seed
        self.tokenizer, self.model = build_model(ctx, opts, "causal_lm")
        self.model.requires_grad_(False)
        self.pad_id = (
            opts.pad_token_id if opts.pad_token_id is not None else self.tokenizer.pad_token_id
        )
        self.eos_ids = eos_ids(
            opts.eos_token_id,
            self.tokenizer.eos_token_id,
            getattr(self.model.generation_config, "eos_token_id", None),
        )
        if opts.stop_on_eos and not self.eos_ids:
            raise ConfigError(f"{options_path(ctx)}.eos_token_id", "the model names no EOS token")
        # Every name the sender may use (tied weights answer to both names) -> parameter.
        self.weights = InPlaceWeights(dict(self.model.named_parameters(remove_duplicate=False)))
        # transformers 5.2x renamed `past_key_values` (forward argument and output) to `cache`.
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward_args else "past_key_values"
        self.loop = trajectory_loop(
            ctx,
            opts,
            self.tokenizer,
            self.eos_ids,
            getattr(self.model.config, "max_position_embeddings", None),
        )
        self.merger = CallMerger(
            self._generate_calls, opts.merge_window_ms / 1e3, "hf-rollout", ctx.compute
        )

    def hold_adapters(self, lora: Mapping[str, Any], seed: int) -> None:
        """Hold a LoRA actor's adapters unmerged (rollout/adapters.py): wrap the model with
        its config; updates then go through AdapterWeights."""
        hold(self.model, lora, seed=seed, path=self._path)
        self.weights = AdapterWeights(self.model)

    def close(self) -> None:
        if self.merger is not None:
            self.merger.close()
            self.merger = None
        self.model = None
        self.weights = None
        if self.loop is not None:
            self.loop.close()
            self.loop = None

    # -- ops -----------------------------------------------------------------------------
    @op(scope=Scope.STEP)
    def sleep(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """No-op here (this backend keeps no cache between calls): presets written for the
        vllm backend run unchanged."""
        return {}, {"rollout/sleep_skipped": 1.0}

    @op(scope=Scope.STEP)
    def wake_up(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """No-op here, see `sleep`."""
        return {}, {"rollout/wake_skipped": 1.0}

    @op(inputs=GENERATE_INPUTS, outputs=GENERATE_OUTPUTS, params=GENERATE_PARAMS, concurrent=True)
    async def generate(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """Checked here, on the loop, in arrival order (seeds follow the call count); run
        in the stage's worker thread, merged with the calls sent with it (merge.py)."""
        assert self.merger is not None
        gang = self._gang(params)
        try:
            opts = self._call_options(params)
            where = "hf rollout generate"
            self._sink().ready(where)
            require(batch, ("prompt_ids", "prompt_mask"), where)
            self._check_prompts(batch["prompt_ids"], batch["prompt_mask"], opts, where)
            call = _Call(batch, opts, self._call_seed(params))
        except BaseException:
            if gang is not None:  # its gang stops waiting for it
                self.merger.leave(*gang)
            raise
        key = tuple(getattr(opts, k) for k in SAMPLING_OVERRIDES)
        if self.loop is not None:  # trajectories: turn by turn, alone
            return await self.merger.call(self._generate_trajectories, call)
        if self.merger.window_s:  # opt-in: whatever arrives together
            return await self.merger.submit(key, call)
        if gang is not None:  # the coordinator's gang, in mb_id order
            return await self.merger.gang(*gang, int(params.get("mb_id", 0)), key, call)
        ((out, metrics),) = await self.merger.call(self._generate_calls, [call])
        return out, metrics

    def _gang(self, params: Params) -> tuple[tuple[Any, ...], int] | None:
        """(gang id, size) when this call is one of a gang of micro-batches to run
        together (`merge_gangs`; Task params mb_gang), else None."""
        size, opts = int(params.get("mb_gang", 1)), self.opts
        if size < 2 or opts is None or opts.merge_window_ms:
            return None
        if not (self.device.type == "cpu" if opts.merge_gangs is None else opts.merge_gangs):
            return None
        if self.loop is not None:  # trajectories run alone
            return None
        return ("gang", params.get("step"), params.get("mb_gang_first")), size

    def _generate_calls(self, calls: list[_Call]) -> list[tuple[Batch, Metrics]]:
        """Calls of the same sampling options as one forward loop over all their rows;
        each call's rows still draw from its own generator (the draws of a call are
        those of running it alone), and each gets its own outputs back."""
        self._sink().ready("hf rollout generate")
        opts = calls[0].opts
        rows = [c.rows for c in calls]  # [B_i * n] per call
        if len(calls) == 1:  # as sent: no re-padding
            ids, mask = calls[0].ids, calls[0].mask
        else:
            ids, mask = pad_left([r for c in calls for r in unpad(c.ids, c.mask)], self.pad_id)
        gens = [torch.Generator(device=self.device).manual_seed(c.seed) for c in calls]
        owner = torch.repeat_interleave(torch.arange(len(calls)), torch.tensor(rows))  # [N]
        t0 = time.perf_counter()
        parts = [
            self._sample(
                ids[part].to(self.device, torch.int64),
                mask[part].to(self.device),
                opts,
                _spans(owner[part], gens),
            )
            for part in row_chunks(ids.shape[0], opts.max_batch_size)
        ]
        gen_s = time.perf_counter() - t0
        width = max(p[0].shape[1] for p in parts)
        response_ids = torch.cat([_pad_to(p[0], width, self.pad_id) for p in parts])  # [N, R]
        logprobs = torch.cat([_pad_to(p[1], width, 0.0) for p in parts])  # [N, R]
        lengths = torch.cat([p[2] for p in parts])  # [N]
        out, start = [], 0
        for c, n in zip(calls, rows, strict=True):
            got = lengths[start : start + n]
            w = max(1, int(got.max()))  # the call's own longest response, as if alone
            metrics = self._generate_metrics(gen_s * n / len(owner), int(got.sum()), n)
            metrics["rollout/concurrent_calls"] = float(len(calls))  # sharing its loop
            batch = {
                "prompt_ids": c.ids,
                "prompt_mask": c.mask,
                "response_ids": response_ids[start : start + n, :w],
                "response_mask": (torch.arange(w)[None, :] < got[:, None]).to(torch.int64),
                "rollout_logprobs": logprobs[start : start + n, :w],
                "group_index": c.group_index,
            }
            out.append((batch, metrics))
            start += n
        return out

    def _generate_trajectories(self, call: _Call) -> tuple[Batch, Metrics]:
        """`generate` with an environment: one trajectory per row (multiturn.py)."""
        assert self.loop is not None
        batch, ids, mask, opts = call.batch, call.ids, call.mask, call.opts
        group_index = call.group_index
        records = trajectory_records(batch, opts.n, "hf rollout generate")
        engine = _HFTurns(self, opts, call.seed)
        t0 = time.perf_counter()
        result = aio.run(self.loop.run(engine, unpad(ids, mask), records, opts.max_new_tokens))
        wall_s = time.perf_counter() - t0
        out = result.tensors(self.pad_id)
        out.setdefault("prompt_ids", ids)
        out.setdefault("prompt_mask", mask)
        out["group_index"] = group_index
        tokens = int(out["response_mask"].sum())  # model tokens (observations excluded)
        metrics = self._generate_metrics(engine.gen_s, tokens, ids.shape[0])
        metrics["rollout/loop_s"] = wall_s
        return out, {**metrics, **result.metrics}

    def _check_prompts(
        self, ids: torch.Tensor, mask: torch.Tensor, opts: HFRolloutOptions, where: str
    ) -> None:
        m = check_prompts(ids, mask, where, self.model.config.vocab_size)
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and int(m.sum(-1).max()) + opts.max_new_tokens > limit:
            raise BatchError(
                f"{where}: prompt of {int(m.sum(-1).max())} tokens + max_new_tokens "
                f"{opts.max_new_tokens} exceeds the model's {limit} positions"
            )

    @torch.no_grad()
    def _sample(
        self,
        ids: torch.Tensor,  # [N, P] left-padded
        mask: torch.Tensor,  # [N, P]
        opts: HFRolloutOptions,
        gens: list[tuple[torch.Generator, slice]],  # who draws the rows of each span
        limits: torch.Tensor | None = None,  # [N] tokens each row may take (<= max_new_tokens)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> tokens [N, T] (pad after the end), logprobs [N, T], lengths [N] (all CPU)."""
        n = ids.shape[0]
        eos = torch.tensor(self.eos_ids, device=self.device, dtype=torch.int64)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        cache = out[self._cache_kw]
        logits = out.logits[:, -1, :].float()  # [N, V]
        next_pos = mask.sum(-1, keepdim=True)  # [N, 1] position of the next token
        finished = torch.zeros(n, dtype=torch.bool, device=self.device)
        lengths = torch.zeros(n, dtype=torch.int64, device=self.device)
        tokens, logprobs = [], []
        live = torch.arange(n, device=self.device)  # the rows the forward runs (see below)
        for t in range(opts.max_new_tokens):
            picked = [_pick(logits[rows], opts, gen) for gen, rows in gens]
            tok = torch.cat([t for t, _ in picked]) if len(picked) > 1 else picked[0][0]
            lp = torch.cat([x for _, x in picked]) if len(picked) > 1 else picked[0][1]
            tok = torch.where(finished, self.pad_id, tok)
            lp = torch.where(finished, 0.0, lp)
            tokens.append(tok)
            logprobs.append(lp)
            lengths += (~finished).to(torch.int64)
            if opts.stop_on_eos:
                finished |= torch.isin(tok, eos)
            if limits is not None:
                finished |= lengths >= limits
            if t == opts.max_new_tokens - 1 or bool(finished.all()):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            live = _shrink(cache, live, finished)
            out = self.model(
                input_ids=tok[live, None],
                attention_mask=mask[live],
                position_ids=next_pos[live],
                use_cache=True,
                **{self._cache_kw: cache},
            )
            cache = out[self._cache_kw]
            next_pos = next_pos + 1
            new = out.logits[:, -1, :].float()
            if live.numel() < n:  # finished rows keep stale logits: sampling still draws for
                logits[live] = new  # every row (the draw discarded), so each generator's
            else:  # stream is the same whichever rows the forward ran
                logits = new
        return (
            torch.stack(tokens, 1).cpu(),
            torch.stack(logprobs, 1).float().cpu(),
            lengths.cpu(),
        )


SHRINK_SHARE = 8  # drop finished rows from the forward once they are 1/8 of its rows


def _shrink(cache: Any, live: torch.Tensor, finished: torch.Tensor) -> torch.Tensor:
    """The rows the next decode forward runs: `live` less the finished rows, once these
    are 1/SHRINK_SHARE of it (the KV cache is cut to the same rows; each cut copies it,
    so not at every finished row). On the CPU the forward costs about its rows (3.2M
    parameters, 64 rows: bench/RESULTS.md session 15); a cache that cannot select rows
    keeps them all."""
    gone = finished[live]
    count = int(gone.sum())  # one read of the device per step
    if count * SHRINK_SHARE < live.numel() or count == live.numel():
        return live
    if not hasattr(cache, "batch_select_indices"):
        return live
    keep = (~gone).nonzero().flatten()
    cache.batch_select_indices(keep)
    return live[keep]


def _pick(
    logits: torch.Tensor, opts: HFRolloutOptions, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from logits [N, V] -> (tokens [N], sampling log-probs [N])."""
    if opts.temperature == 0:
        tok = logits.argmax(-1)
        return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
    scaled = logits / opts.temperature
    if 0 < opts.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, opts.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if opts.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the first
        # token is always kept).
        drop = (probs.cumsum(-1) - probs) >= opts.top_p
        scaled = scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    logp = torch.log_softmax(scaled, dim=-1)
    tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class _Call:
    """One generate call, checked: its batch, options and seed; its prompts repeated n
    times (ids, mask [B*n, P]) and each row's prompt (group_index [B*n])."""

    def __init__(self, batch: Batch, opts: HFRolloutOptions, seed: int) -> None:
        self.batch, self.opts, self.seed = batch, opts, seed
        b = batch["prompt_ids"].shape[0]
        self.ids = batch["prompt_ids"].repeat_interleave(opts.n, dim=0)
        self.mask = batch["prompt_mask"].to(torch.int64).repeat_interleave(opts.n, dim=0)
        self.group_index = torch.arange(b).repeat_interleave(opts.n)
        self.rows = b * opts.n


def _spans(owner: torch.Tensor, gens: list[torch.Generator]) -> list[tuple[torch.Generator, slice]]:
    """owner [N] (each row's call, non-decreasing) -> (that call's generator, its rows)."""
    out, start = [], 0
    for call, count in zip(*torch.unique_consecutive(owner, return_counts=True), strict=True):
        out.append((gens[int(call)], slice(start, start + int(count))))
        start += int(count)
    return out


def _pad_to(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype)
    return torch.cat([t, pad], dim=1)


class _HFTurns:
    """The hf sampler as the trajectory loop's turn engine (multiturn.TurnEngine): each
    turn's contexts are left-padded and sampled together, whole (no KV is kept between
    turns: `appended` is not used), each row up to its own token limit. Not continuous:
    a turn's samples depend on the batch they share (one generator), so the loop runs
    turn-synchronously."""

    continuous = False

    def __init__(self, rollout: HFRollout, opts: HFRolloutOptions, seed: int) -> None:
        self.rollout, self.opts, self.seed = rollout, opts, seed
        self.gen_s = 0.0

    async def generate(self, requests: Sequence[TurnRequest], turn: int) -> list[TurnOutput]:
        r = self.rollout
        # One generator per turn, seeded from (the call's seed: seed, step, mb_id; turn).
        gen = torch.Generator(device=r.device).manual_seed(mix_seed(self.seed, "turn", turn))
        ids, mask = pad_left([q.context_ids for q in requests], r.pad_id)  # [N, C]
        limits = torch.tensor([q.max_new_tokens for q in requests], dtype=torch.int64)  # [N]
        opts = replace(self.opts, max_new_tokens=int(limits.max()))
        stop = set(r.eos_ids) if opts.stop_on_eos else set()
        t0 = time.perf_counter()
        out: list[TurnOutput] = []
        for rows in row_chunks(ids.shape[0], opts.max_batch_size):
            tokens, logprobs, lengths = r._sample(
                ids[rows].to(r.device),
                mask[rows].to(r.device),
                opts,
                [(gen, slice(None))],
                limits[rows].to(r.device),
            )
            for b in range(tokens.shape[0]):
                k = int(lengths[b])
                row_ids = tokens[b, :k].tolist()
                out.append(
                    TurnOutput(
                        row_ids, logprobs[b, :k].tolist(), bool(row_ids) and row_ids[-1] in stop
                    )
                )
        self.gen_s += time.perf_counter() - t0
        return out

    def end(self, keys: Sequence[int]) -> None:
        """Nothing is kept between turns."""

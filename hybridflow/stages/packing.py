"""Packed forwards and token-budget row groups for the model-backed roles (actor,
reference, critic): what the model computes, not what it sees. Every op still takes and
returns the padded layout of stages/common.py ([B, P] prompts, [B, R] responses).

Three options (`PackingOptions`, mixed into each role's options), each off by default
(the third, `compile_layers`, is at the end of this module: how the same forwards run):

  max_tokens_per_micro_batch: K > 0   a micro-batch reaches the model in groups of rows
                                      (longest first) whose forward computes <= K
                                      positions: a padded group's rows x (its longest
                                      prompt + its longest response span), a packed
                                      group's real tokens; a row longer than K is a group
                                      of its own; `forward_batch_size`, when also set,
                                      still caps a group's rows. 0: groups of
                                      `forward_batch_size` rows, as before.
  pack_sequences: true                each group runs as ONE sequence of its rows' real
                                      tokens back to back (no padding is computed).

The budget bounds the positions a forward computes, so it is the memory bound of either
forward. Counting real tokens for a padded group (as before) let the padding
grow unbounded: on a micro-batch of grpo-gpu-real's shapes (bench/actor_profile.py, 64
rows, 26,501 real tokens) a 16,384-token budget made 2 forwards of 46,122 positions in
all (42.5% padding; the first forward 29,250 positions); counted in positions, 3 forwards
of 38,584 (31.3%), none over 16,384. They are two options, not one, because packing on
its own is one packed sequence per `forward_batch_size` rows.

A packed group of B rows (document b: its prompt's real tokens, then its response span):

    input_ids     [1, T]   T = sum of the rows' real tokens
    position_ids  [1, T]   0, 1, ... restarting at every document: at each token exactly
                           the padded path's cumsum(mask) - 1
    predict       [N]      the packed index of the position that predicts each valid
                           response token (response_mask 1), in row-major [B, R] order:
                           the order `response_mask != 0` selects, so values scatter back
                           to [B, R] unchanged

Document-masked attention comes from transformers itself: called with no attention mask
and position ids that restart, its mask builder (masking_utils.find_packed_sequence_indices,
transformers >= 4.54) makes each document attend only to itself, for every kernel:
`sdpa`/`eager` get a [1, 1, T, T] block-diagonal causal mask (materialised, and sdpa
computes every block of it), `flex_attention` a BlockMask (blocks outside the documents
are skipped, no T x T tensor), `flash_attention_*` varlen over the documents. So packing
on a GPU pays off with a kernel that skips the masked blocks; with sdpa a long packed
group can do more attention work than the padded rows it replaced. The project's own
`varlen` (models/varlen.py) takes the documents as cumulative lengths instead, which the
roles' packed forward passes (stages/common._layout) with an all-ones mask, so the mask
builder is skipped: torch's varlen flash kernel on a GPU. On an H100 a qwen2-1.5b update
with it (and the head kernel) ran at 36.9-38.0% MFU against 25.2-26.1% padded
(bench/RESULTS.md, session 18).

Invariants: a packed forward's per-token outputs equal the padded forward's up to float
rounding (tests/stages/test_stages_packing.py); the groups partition the rows (in order, or longest first with a budget);
a group's trimmed forward equals its untrimmed one up to float rounding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.config.fields import FIELDS
from hybridflow.errors import ConfigError
from hybridflow.models import varlen
from hybridflow.models.kernels import failure

log = logging.getLogger(__name__)

# transformers' attention kernels whose mask builder knows packed position ids.
# "varlen" is the project's own (models/varlen.py): documents from cumulative lengths.
PACKABLE_ATTENTION = (
    "sdpa",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "varlen",
)


@dataclass
class PackingOptions:
    """How a role groups a micro-batch's rows into forwards (module docstring)."""

    # Positions per forward/backward (padded: rows x the group's width; packed: real
    # tokens): rows, longest first, up to this many form one forward, a longer row goes
    # alone; 0: rows by forward_batch_size
    max_tokens_per_micro_batch: int = 0
    # Each forward as one packed sequence of its rows' real tokens (no padding), with
    # document-masked attention. Off by default: with sdpa (the default kernel) the
    # packed mask is T x T and fully computed; varlen / flex_attention / flash skip the
    # masked blocks (varlen measured on an H100, bench/RESULTS.md session 18)
    pack_sequences: bool = False
    # torch.compile each decoder layer (end of stages/packing.py): fused elementwise kernels in
    # forward and backward; setup compiles every variant (about a minute on an H200, more
    # on a CPU). Not with fsdp. grpo-gpu-real turns it on (43.6 against 38.2 samples/s on
    # an H200, bench/RESULTS.md); off by default, where the compile would outlast a short run
    compile_layers: bool = False

    def validate_packing(self, path: str) -> None:
        if self.max_tokens_per_micro_batch < 0:
            raise ConfigError(
                f"{path}.max_tokens_per_micro_batch" if path else "max_tokens_per_micro_batch",
                f"must be >= 0 (0: rows by forward_batch_size), got "
                f"{self.max_tokens_per_micro_batch}",
            )


def check_packing(opts: PackingOptions, model: Any, sharded: bool, path: str) -> None:
    """ConfigError when the options cannot run on this model (at setup, not mid-step)."""
    if opts.max_tokens_per_micro_batch > 0 and sharded:
        # FSDP gathers each layer in every forward: ranks must run the same number of
        # forwards, and token-budget groups of different rows differ in number.
        raise ConfigError(
            f"{path}.max_tokens_per_micro_batch",
            "is not supported with a sharded model (fsdp): ranks would run different "
            "numbers of forwards; set it to 0 and bound rows with forward_batch_size",
        )
    if opts.pack_sequences:
        kernel = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if kernel not in PACKABLE_ATTENTION:
            raise ConfigError(
                f"{path}.pack_sequences",
                f"needs an attention kernel that masks packed documents "
                f"({', '.join(PACKABLE_ATTENTION)}); the model uses {kernel!r}",
            )
        why = varlen.unsupported(model) if kernel == varlen.NAME else None
        if why is not None:
            raise ConfigError(
                f"{path}.attn_implementation",
                f"'varlen' cannot run the packed forwards: {why}; use flex_attention or sdpa",
            )


def response_span(response_mask: torch.Tensor) -> torch.Tensor:
    """[B, R] 0/1 -> [B, R] int64: 1 at every position up to each row's last 1 (the
    response's real tokens, observations included), 0 in the right padding after it."""
    m = response_mask.to(torch.int64)
    return m.flip(-1).cummax(-1).values.flip(-1)


def row_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B] int64: each row's real tokens, the length of its packed document."""
    prompt = batch["prompt_mask"].to(torch.int64).sum(-1)
    return prompt + response_span(batch["response_mask"]).sum(-1)


def padded_groups(
    prompts: Sequence[int], spans: Sequence[int], budget: int, max_rows: int
) -> Iterator[slice]:
    """Consecutive row slices whose padded forward computes <= `budget` positions: rows x
    (the group's longest prompt + its longest response span), the width `group_batch`
    leaves it; a row over the budget alone; at most `max_rows` rows (<= 0: no bound)."""
    start, p, r = 0, 0, 0
    for i, (pi, ri) in enumerate(zip(prompts, spans, strict=True)):
        wide_p, wide_r = max(p, pi), max(r, ri)
        over_budget = (i - start + 1) * (wide_p + wide_r) > budget
        if i > start and (over_budget or (max_rows > 0 and i - start >= max_rows)):
            yield slice(start, i)
            start, wide_p, wide_r = i, pi, ri
        p, r = wide_p, wide_r
    if start < len(prompts):
        yield slice(start, len(prompts))


def row_groups(tokens: Sequence[int], budget: int, max_rows: int) -> Iterator[slice]:
    """Consecutive row slices: each holds as many rows as fit `budget` tokens (<= 0: no
    bound) and at most `max_rows` rows (<= 0: no bound); a row over the budget alone."""
    start, used = 0, 0
    for i, n in enumerate(tokens):
        over_budget = budget > 0 and used + n > budget
        if i > start and (over_budget or (max_rows > 0 and i - start >= max_rows)):
            yield slice(start, i)
            start, used = i, 0
        used += n
    if start < len(tokens):
        yield slice(start, len(tokens))


Rows = slice | torch.Tensor  # a group: consecutive rows, or row indices (length-sorted)


def forward_groups(
    batch: dict[str, torch.Tensor], opts: PackingOptions, max_rows: int
) -> Iterator[Rows]:
    """The row groups of one micro-batch's forwards (`max_rows`: forward_batch_size).
    With a token budget the rows are grouped longest first (a stable sort), so a group
    holds rows of similar length and its padded forward (`group_batch` trims the
    columns no row of it uses) computes little padding: rollout lengths are long-tailed,
    and consecutive rows padded to the longest of a whole micro-batch computed mostly
    padding (grpo-gpu-real: mean response 320 of up to 1024)."""
    budget = opts.max_tokens_per_micro_batch
    if budget > 0:
        prompt = batch["prompt_mask"].to(torch.int64).sum(-1)
        span = response_span(batch["response_mask"]).sum(-1)
        tokens = prompt + span  # row_tokens, from its parts
        order = torch.sort(tokens, descending=True, stable=True).indices
        if opts.pack_sequences:  # a packed forward computes its real tokens
            groups = row_groups(tokens[order].tolist(), budget, max_rows)
        else:
            groups = padded_groups(prompt[order].tolist(), span[order].tolist(), budget, max_rows)
        for sl in groups:
            yield order[sl]
    else:
        yield from row_groups([1] * batch["response_mask"].shape[0], max_rows, 0)


_PROMPT_WIDE = {k for k, f in FIELDS.items() if f.shape.startswith("[B, P]")}
_RESPONSE_WIDE = {k for k, f in FIELDS.items() if f.shape.startswith("[B, R]")}


def group_batch(batch: dict[str, torch.Tensor], rows: Rows) -> dict[str, torch.Tensor]:
    """The rows `rows` of `batch`; a length-sorted group (an index tensor, as
    `forward_groups` makes with a token budget) without the padding columns none of its
    rows uses: prompt
    columns before the group's longest (left-padded) prompt, response columns after its
    longest response span. Every value the width of the prompts ([B, P] fields) or of
    the responses ([B, R] fields, and any other value that wide) is cut alike. Padding
    feeds nothing a loss or a log-prob reads (every op masks it; positions are
    cumsum(mask) - 1, which leading padding does not change), so only the work changes;
    outputs [b, r] are padded back by `gather_rows`."""
    sub = {k: v[rows] for k, v in batch.items()}
    if isinstance(rows, slice) or "prompt_mask" not in sub or "response_mask" not in sub:
        # Consecutive rows keep the micro-batch's width. Measured on an H200
        # (grpo-gpu-real, bench/RESULTS.md): trimming groups of 8 consecutive rows made the
        # step 12% slower (22.0 against 24.7 samples/s; every forward a new shape, and
        # cuDNN attention plans per shape), while trimmed length-sorted budget groups made
        # it 32% faster (32.6).
        return sub
    p, r = sub["prompt_mask"].shape[1], sub["response_mask"].shape[1]
    first = p - max(1, int(sub["prompt_mask"].sum(-1).max()))
    last = max(1, int(response_span(sub["response_mask"]).sum(-1).max()))
    for k, v in sub.items():
        if v.dim() < 2:
            continue
        if k in _PROMPT_WIDE and first > 0:
            sub[k] = v[:, first:]
        elif (k in _RESPONSE_WIDE or (k not in FIELDS and v.shape[1] == r)) and last < r:
            sub[k] = v[:, :last]
    return sub


def gather_rows(parts: list[tuple[Rows, torch.Tensor]], n: int, width: int) -> torch.Tensor:
    """Group outputs -> [n, ...] in the micro-batch's row order; [b, r] outputs are
    zero-padded to `width` columns (what `group_batch` cut was padding)."""
    first = parts[0][1]
    shape = (n, width, *first.shape[2:]) if first.dim() >= 2 else (n, *first.shape[1:])
    out = torch.zeros(shape, dtype=first.dtype, device=first.device)
    for rows, value in parts:
        if value.dim() >= 2:
            out[rows, : value.shape[1]] = value
        else:
            out[rows] = value
    return out


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    predict: torch.Tensor  # [N] int64: packed positions predicting the valid response tokens
    valid: torch.Tensor  # [B, R] bool: response_mask != 0, where the N values go


def pack_rows(batch: dict[str, torch.Tensor], device: torch.device) -> PackedRows:
    """The packed sequence of `batch`'s rows (module docstring)."""
    p = batch["prompt_ids"].shape[1]
    r = batch["response_ids"].shape[1]
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1).to(device, torch.int64)
    keep = torch.cat(
        [batch["prompt_mask"].to(torch.int64), response_span(batch["response_mask"])], dim=1
    ).to(device)  # [B, P+R]: the real tokens, each row's document
    real = keep.bool()
    # The padded path's positions (cumsum(mask) - 1), read at the real tokens only.
    pos = (keep.cumsum(-1) - 1)[real]
    # Packed index of every kept [B, P+R] cell: the kept cells before it, row-major.
    packed_at = keep.flatten().cumsum(0).view(keep.shape) - 1
    valid = batch["response_mask"].to(device) != 0
    # Column P - 1 + t predicts response token t; it is a real token for every valid t
    # (the prompt's last token, which is never padding, or a response span token).
    predict = packed_at[:, p - 1 : p - 1 + r][valid]
    return PackedRows(ids[real].unsqueeze(0), pos.unsqueeze(0), predict, valid)


def scatter_rows(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N] -> [B, R], 0 where `valid` is False (grad flows to `values`)."""
    return torch.zeros(valid.shape, dtype=values.dtype, device=values.device).masked_scatter(
        valid, values
    )


# -- compile_layers ------------------------------------------------------------------
# `compile_layers`: the training roles' decoder layers through torch.compile (issue 25).
#
# Profiled on an H200 (bench/actor_profile.py, bench/RESULTS.md): an actor `update` of
# `grpo-gpu-real`'s shapes spends about a quarter of its device time in GEMMs and most of
# the rest in elementwise kernels (RMSNorm's eight ops, RoPE, SiLU*mul, residual adds,
# autocast's casts), each a pass over [tokens, hidden] forward and backward. Compiling
# each decoder layer (as torchtitan compiles each block) lets inductor fuse them.
#
# dynamic=True: the actor's forwards come in many shapes (token-budget groups, each cut
# to its own longest row), and one compilation with symbolic sizes serves them all.
# Refused with FSDP for now (the shards' hooks run inside the compiled call; not measured).
#
# Variants. Every layer of a process shares one compiled frame, and dynamo still keeps a
# separate graph per (grad mode, autocast state) pair, for a group of ONE row (symbolic
# sizes specialise 0 and 1) and for a group with no padding at all (transformers then
# passes `attention_mask=None`, a type guard). A hybrid engine's actor (update with grad,
# log-probs without) and reference (no grad, its own dtype) meet about twelve, more than
# dynamo's default recompile_limit of 8, past which the frame silently runs eagerly; and
# the rare ones (an unpadded group, a lone row) first appear steps into a run, each a
# compile of tens of seconds mid-step. On an H200 that (most likely) made three compiled
# steps of grpo-gpu-real slower than eager ones although one micro-batch ran 1.44x faster;
# warmed, they are 1.14x faster end to end (bench/RESULTS.md). So `compile_layers` raises
# the limit and, given the role's forward, runs it at setup on tiny synthetic groups of
# each variant: the compiles are paid before the first step, not inside the steps.
# Inductor adds guards of its own that tiny groups cannot cover, a length's alignment or
# a fusion size threshold: on the H200, with tiny groups only, three more graphs compiled
# in grpo-gpu-real's first step (none after). So with a token budget one budget-sized
# group of an aligned length is warmed too; on CPU that moved the C++ backend's
# size-guarded graph (B x T > 4096) from the first step to setup. Not yet measured on a
# GPU.

RECOMPILE_LIMIT = 64  # per frame: ~4 shape variants x the grad/autocast modes of 3 roles


def decoder_layers(model: Any) -> list[Any] | None:
    """The transformer blocks of an HF model (under peft's wrapper too), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(base, "model", None)
    layers = getattr(body, "layers", None)
    return list(layers) if layers is not None else None


def compile_layers(
    on: bool,
    model: Any,
    sharded: bool,
    path: str,
    run: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None,  # a group's forward
    grads: Sequence[bool] = (False,),  # the grad modes the role's ops run `run` in
    budget: int = 0,  # the role's max_tokens_per_micro_batch (0: none)
) -> int:
    """Compile each decoder layer in place (module.compile) if `on`, then, given the
    role's forward `run`, compile its every variant now (`_warm`); returns how many
    layers."""
    if not on:
        return 0
    key = f"{path}.compile_layers" if path else "compile_layers"
    if sharded:
        raise ConfigError(key, "is not supported with a sharded model (fsdp) yet")
    layers = decoder_layers(model)
    if not layers:
        raise ConfigError(key, f"{type(model).__name__} has no model.layers to compile")
    import torch._dynamo

    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    for layer in layers:
        layer.compile(dynamic=True)
    if run is not None:
        try:
            _warm(model, run, grads, budget)
        except Exception as e:
            return _uncompile(model, layers, run, key, e)
    return len(layers)


def _uncompile(
    model: Any,
    layers: list[Any],
    run: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    key: str,
    e: Exception,
) -> int:
    """The warm-up failed. Where inductor cannot build on this machine (no C compiler for
    its Triton or C++ kernels, an inductor gap) the layers go back to eager with a warning
    giving the cause, as the native engine's compile_decode does: the preset that turns
    compile_layers on must still run there, only slower. If one eager forward fails too,
    the fault is not the compiler's, and that forward's own error is raised."""
    for layer in layers:
        layer._compiled_call_impl = None  # what nn.Module.compile set: eager again
    for p in model.parameters():
        p.grad = None
    with torch.no_grad():
        run(_warm_group(1, False, int(model.config.vocab_size)))
    log.warning("%s: torch.compile failed at setup (%s); the layers run eagerly", key, failure(e))
    return 0


def _warm_group(rows: int, padded: bool, vocab: int, length: int = 6) -> dict[str, torch.Tensor]:
    """A synthetic group of `rows` rows of `length` positions (3 prompt, the rest
    response): with `padded` the last row's prompt is left-padded and its response one
    token short, so the group has an attention mask; without, it has none (module comment
    above)."""
    p, r = 3, length - 3
    pm = torch.ones(rows, p, dtype=torch.int64)
    rm = torch.ones(rows, r, dtype=torch.int64)
    if padded:
        pm[-1, 0] = 0
        rm[-1, -1] = 0
    ids = torch.arange(rows * length, dtype=torch.int64).remainder(vocab).view(rows, length)
    return {
        "prompt_ids": ids[:, :p] * pm,
        "prompt_mask": pm,
        "response_ids": ids[:, p:] * rm,
        "response_mask": rm,
    }


_WARM_LENGTH = 64  # positions per row of the budget-sized warm group: aligned, and short


def _warm_groups(vocab: int, budget: int) -> list[dict[str, torch.Tensor]]:
    """The groups the warm-up runs: the four kinds of the module comment, tiny (an
    unaligned length of 6), and with a token budget one group as large as the budget, of
    rows of an aligned length: inductor's own guards on a size threshold or a length's
    alignment then see both sides before the first step (module comment). Its rows are
    short (positions within any model's range, attention cheap even where the kernel
    materialises scores) and many."""
    groups = [_warm_group(rows, padded, vocab) for rows in (1, 2) for padded in (False, True)]
    rows = budget // _WARM_LENGTH
    if rows >= 2:
        groups.append(_warm_group(rows, True, vocab, _WARM_LENGTH))
    return groups


def _warm(
    model: Any,
    run: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    grads: Sequence[bool],
    budget: int,
) -> None:
    """Compile every variant of the role's forward now (module comment above): `run` on
    `_warm_groups` under each grad mode; with grad, a backward too (its graph compiles
    at the first backward), whose gradients are then dropped so the role starts as if
    nothing ran."""
    groups = _warm_groups(int(model.config.vocab_size), budget)
    for grad in grads:
        for group in groups:
            with torch.set_grad_enabled(grad):
                out = run(group)
                if grad:
                    out.float().sum().backward()
    for p in model.parameters():
        p.grad = None

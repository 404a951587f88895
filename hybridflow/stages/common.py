"""Shared pieces of the HF role backends: batch checks, the prompt+response forward, seeds.

Every model-backed role sees sequences in one layout (the rollout's output):

    prompt_ids     [B, P] int   left-padded        prompt_mask   [B, P] 0/1
    response_ids   [B, R] int   right-padded       response_mask [B, R] 0/1

The forward runs on `[prompt | response]` (length P + R) with the concatenated attention
mask and position ids `cumsum(mask) - 1`, so padding on either side changes no real token's
output. Response token t is predicted at position P - 1 + t; every per-token output
(log-probs, entropy, values) is taken there and laid out [B, R], 0 where response_mask is 0.

The response's attention mask is its *span*: 1 up to the row's last response_mask 1,
not response_mask itself. A multi-turn response (stages/rollout/multiturn.py) has
interior zeros on observation tokens: they are context the model read while generating
the next turn (the sampler attended to them at their positions), but not its actions.
Attending to them keeps every model token's log-prob the rollout's; the zeros still
keep them out of every loss. For a single-turn response (ones, then padding) the span
is response_mask exactly.

Invariants: inputs are validated before any model call (a malformed batch is a
BatchError naming role, op and field); outputs leave on CPU as float32.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from hybridflow.algos.losses import entropy_from_logits, logprobs_from_logits
from hybridflow.algos.utils import zero_padding
from hybridflow.config.fields import SEQUENCE_FIELDS as SEQUENCE_FIELDS  # the roles' inputs
from hybridflow.errors import BatchError
from hybridflow.models import varlen
from hybridflow.models.head_logprobs import chunkable, model_head_logprobs
from hybridflow.models.loader import ModelKind, ModelOptions, load_model, load_tokenizer
from hybridflow.stages.base import Batch, StageContext
from hybridflow.stages.packing import (
    Rows,
    gather_rows,
    group_batch,
    pack_rows,
    response_span,
    row_tokens,
    scatter_rows,
)

_CHUNK = 1024  # positions per float32 chunk in no-grad log-prob / entropy


def options_path(ctx: StageContext) -> str:
    """Dotted config key of this role's `options:` block, for error messages."""
    role = ctx.world.role
    return f"stages.{ctx.stage}.roles.{role}.options" if role else f"stages.{ctx.stage}.options"


def mix_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any parts (same parts, same seed, in every process)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def require(batch: Batch, names: Sequence[str], where: str) -> None:
    """Raise BatchError unless every name is in `batch` and all share the batch dim."""
    missing = [n for n in names if n not in batch]
    if missing:
        raise BatchError(f"{where}: batch lacks {missing}; it has {sorted(batch)}")
    rows = {n: batch[n].shape[0] if batch[n].dim() else None for n in names}
    if len(set(rows.values())) != 1 or None in rows.values():
        raise BatchError(f"{where}: fields disagree on the batch size: {rows}")
    if next(iter(rows.values())) == 0:
        raise BatchError(f"{where}: empty batch (B = 0)")


def check_ids_mask(
    ids: torch.Tensor, mask: torch.Tensor, ids_name: str, mask_name: str, where: str, dims: str
) -> torch.Tensor:
    """Token ids [B, T] integer and their mask [B, T] of 0/1 -> the mask as int64.
    `dims` names the shape in the message (`[B, T]`, `[B, P]`)."""
    if ids.dim() != 2 or ids.shape != mask.shape:
        raise BatchError(
            f"{where}: {ids_name} {tuple(ids.shape)} and {mask_name} {tuple(mask.shape)} "
            f"must both be {dims}"
        )
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise BatchError(f"{where}: {ids_name} must be integer, got {ids.dtype}")
    m = mask.to(torch.int64)
    if not bool(((m == 0) | (m == 1)).all()):
        raise BatchError(f"{where}: {mask_name} must hold only 0 and 1")
    return m


def check_sequences(batch: Batch, where: str, vocab_size: int | None = None) -> None:
    """Validate the four sequence fields (module docstring layout)."""
    require(batch, SEQUENCE_FIELDS, where)
    for ids_name, mask_name in (("prompt_ids", "prompt_mask"), ("response_ids", "response_mask")):
        ids = batch[ids_name]
        m = check_ids_mask(ids, batch[mask_name], ids_name, mask_name, where, "[B, T]")
        if vocab_size is not None:
            valid = ids[m.bool()]
            if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab_size):
                raise BatchError(
                    f"{where}: {ids_name} holds ids outside the vocabulary [0, {vocab_size})"
                )
    if not bool(batch["prompt_mask"].to(torch.int64).sum(-1).gt(0).all()):
        raise BatchError(f"{where}: some rows have an empty prompt")


def check_left_padded(mask: torch.Tensor, where: str) -> None:
    m = mask.to(torch.int64)
    bad = (m[:, 1:] < m[:, :-1]).any(dim=1)
    if bool(bad.any()):
        rows = torch.nonzero(bad).flatten().tolist()
        raise BatchError(
            f"{where}: prompts must be left-padded (mask 0..0 1..1); rows {rows[:8]} are not"
        )


def sequence_inputs(batch: Batch, device: torch.device) -> tuple[torch.Tensor, ...]:
    """-> input_ids [B, P+R], attention_mask [B, P+R], position_ids [B, P+R] (the
    response's attention is its span: module docstring)."""
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1).to(device, torch.int64)
    span = response_span(batch["response_mask"])
    mask = torch.cat([batch["prompt_mask"].to(torch.int64), span], dim=1).to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def row_chunks(n: int, size: int) -> Iterator[slice]:
    """Row slices of at most `size` rows (size <= 0: one slice)."""
    step = n if size <= 0 else size
    for i in range(0, n, step):
        yield slice(i, min(i + step, n))


def slice_rows(batch: Batch, rows: slice) -> Batch:
    return {k: v[rows] for k, v in batch.items()}


def _forward_kwargs(model: torch.nn.Module, keep: int | torch.Tensor) -> dict[str, Any]:
    params = inspect.signature(model.forward).parameters
    # `logits_to_keep` (transformers >= 4.50) computes the LM head on the last `keep`
    # positions only (or, a 1-D tensor, on those positions): the prompt's logits are
    # never materialised.
    return {"logits_to_keep": keep} if "logits_to_keep" in params else {}


Select = Callable[[torch.Tensor], torch.Tensor]  # model output [b, K, *] -> [N, *]


def _layout(
    model: torch.nn.Module, batch: Batch, device: torch.device, packed: bool
) -> tuple[dict[str, Any], Select, torch.Tensor]:
    """The model call for `batch` -> (its kwargs, `select`: its per-position output
    [b, K, *] -> the N positions predicting a valid response token [N, *], in the order
    of `valid` [B, R] (= response_mask != 0)). Padded: the module docstring's layout;
    packed: stages/packing.py's, the same N positions in one [1, T] sequence."""
    if not packed:
        ids, mask, pos = sequence_inputs(batch, device)
        r = batch["response_ids"].shape[1]
        valid = batch["response_mask"].to(device) != 0
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
        inputs |= _forward_kwargs(model, r + 1)

        def select(out: torch.Tensor) -> torch.Tensor:
            # [B, K, *] (K = R + 1 with logits_to_keep, else P + R): position P - 1 + t
            # predicts response token t.
            return out[:, -(r + 1) : -1][valid]

        return {**inputs, "use_cache": False}, select, valid
    rows = pack_rows(batch, device)
    inputs = {"input_ids": rows.input_ids, "position_ids": rows.position_ids}
    if getattr(model.config, "_attn_implementation", None) == varlen.NAME:
        # The documents as cumulative lengths (host values: no device sync) and a mask
        # saying "no padding", which keeps transformers from building a document mask.
        inputs |= varlen.packed_kwargs(row_tokens(batch).tolist(), device)
        inputs["attention_mask"] = torch.ones_like(rows.input_ids)
    # Otherwise no attention mask: transformers builds the document mask from the
    # restarting position ids (stages/packing.py).
    kept = _forward_kwargs(model, rows.predict)
    inputs |= kept

    def select_packed(out: torch.Tensor) -> torch.Tensor:  # [1, N or T, *] -> [N, *]
        return out[0] if kept else out[0, rows.predict]

    return {**inputs, "use_cache": False}, select_packed, rows.valid


def response_logits(
    model: torch.nn.Module, batch: Batch, device: torch.device, temperature: float = 1.0
) -> torch.Tensor:
    """Logits that predict each response token: [B, R, V] (divided by `temperature`)."""
    ids, mask, pos = sequence_inputs(batch, device)
    r = batch["response_ids"].shape[1]
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        use_cache=False,
        **_forward_kwargs(model, r + 1),
    )
    logits = out.logits[:, -(r + 1) : -1, :]  # position P-1+t predicts response token t
    return logits / temperature if temperature != 1.0 else logits


def response_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    device: torch.device,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int = 0,
    packed: bool = False,
    kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> logprobs [B, R] float32 of the response tokens (grad flows if enabled) and,
    with `with_entropy`, the policy entropy [B, R] (with grad only if `entropy_grad`).
    Both are 0 at padding.

    `chunk_tokens > 0` (the roles' `logprob_chunk_tokens`): only the valid response
    positions reach the head, `chunk_tokens` of them at a time, in forward and backward
    (models/head_logprobs.py); no [B, R, V] logits exist. 0, or a model whose forward
    transforms its head's logits (`chunkable`): the full logits, as before. `kernel`:
    the chunks' passes in Triton on a GPU (`logprob_kernel`, models/head_kernel.py).
    `packed`: the rows run as one packed sequence (stages/packing.py); same outputs."""
    if chunk_tokens > 0 and chunkable(model) is None:
        return _chunked_response_logprobs(
            model,
            batch,
            device,
            temperature,
            with_entropy,
            entropy_grad,
            chunk_tokens,
            packed,
            kernel,
        )
    if packed:
        return _packed_full_logprobs(model, batch, device, temperature, with_entropy, entropy_grad)
    logits = response_logits(model, batch, device, temperature)
    mask = batch["response_mask"].to(device)
    # Without grad, float32 temporaries are bounded to _CHUNK positions at a time (a
    # [B*R, V] upcast of a 150k-token vocabulary would otherwise dwarf the model).
    chunk = None if torch.is_grad_enabled() else _CHUNK
    logprobs = logprobs_from_logits(
        logits, batch["response_ids"].to(device), mask, chunk_size=chunk
    )
    entropy = None
    if with_entropy:
        entropy = _entropy(logits, entropy_grad)
        entropy = zero_padding(entropy, mask)
    return logprobs, entropy


def _entropy(logits: torch.Tensor, grad: bool) -> torch.Tensor:
    """logits [b, n, V] -> entropy [b, n] (without grad: float32 in _CHUNK positions)."""
    if grad:
        return entropy_from_logits(logits)
    with torch.no_grad():
        return entropy_from_logits(logits.detach(), chunk_size=_CHUNK)


def _packed_full_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    device: torch.device,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """response_logprobs' full-logits path on a packed forward: [N, V] logits, never
    [T, V] with logits_to_keep (the prompt positions get none)."""
    inputs, select, valid = _layout(model, batch, device, packed=True)
    logits = select(model(**inputs).logits).unsqueeze(0)  # [1, N, V]
    if temperature != 1.0:
        logits = logits / temperature
    targets = batch["response_ids"].to(device, torch.int64)[valid].unsqueeze(0)  # [1, N]
    chunk = None if torch.is_grad_enabled() else _CHUNK
    lp = logprobs_from_logits(logits, targets, chunk_size=chunk)[0]
    ent = _entropy(logits, entropy_grad)[0] if with_entropy else None
    return scatter_rows(lp, valid), (None if ent is None else scatter_rows(ent, valid))


def _chunked_response_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    device: torch.device,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    chunk_tokens: int,
    packed: bool,
    kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    inputs, select, valid = _layout(model, batch, device, packed)
    targets = batch["response_ids"].to(device, torch.int64)[valid]  # [N]
    lp, ent = model_head_logprobs(
        model,
        inputs,
        select,
        targets,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        kernel=kernel,
    )
    return scatter_rows(lp, valid), (None if ent is None else scatter_rows(ent, valid))


def response_values(
    model: torch.nn.Module, batch: Batch, device: torch.device, packed: bool = False
) -> torch.Tensor:
    """Critic values [B, R] float32: V(state before response token t), 0 at padding.

    `model` is a token-classification model with one label (trunk + linear head);
    `packed`: its rows run as one packed sequence (stages/packing.py), same values."""
    if packed:
        inputs, select, valid = _layout(model, batch, device, packed=True)
        return scatter_rows(select(model(**inputs).logits)[:, 0].float(), valid)
    ids, mask, pos = sequence_inputs(batch, device)
    r = batch["response_ids"].shape[1]
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
    values = out.logits[:, -(r + 1) : -1, 0].float()
    return zero_padding(values, batch["response_mask"].to(device))


def chunked_no_grad(
    fn: Any, batch: Batch, size: int, groups: Iterable[Rows] | None = None
) -> torch.Tensor:
    """Run `fn(sub_batch) -> [b, ...]` over row groups (`groups`, default: `size` rows at
    a time; each trimmed of its unused padding, packing.group_batch) under no_grad ->
    [B, ...] on CPU in the batch's row order, [b, r] outputs padded back to [B, R]."""
    n = next(iter(batch.values())).shape[0]
    rows = row_chunks(n, size) if groups is None else groups
    with torch.no_grad():
        parts = [(sl, fn(group_batch(batch, sl)).detach().float().cpu()) for sl in rows]
    return gather_rows(parts, n, batch["response_ids"].shape[1])


def to_cpu(obj: Any) -> Any:
    """A copy of nested dicts/lists/tuples with every tensor copied to CPU (checkpoints).

    Always a copy, also for CPU tensors: a state that aliased live optimizer buffers
    would change under the caller's feet at the next step."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as CPU tensors (checkpoint form; tied weights appear once per name)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def build_model(
    ctx: StageContext, opts: ModelOptions, kind: ModelKind = "causal_lm"
) -> tuple[Any, torch.nn.Module]:
    """Tokenizer + model of a role, on `ctx.device`. Random init is seeded with the run
    seed (not seed + replica): every role that builds the same preset gets the same
    initial weights (actor, reference and rollout start from one policy)."""
    path = options_path(ctx)
    tokenizer = load_tokenizer(opts.tokenizer, opts.model, f"{path}.tokenizer")
    model = load_model(opts, tokenizer, kind=kind, device=ctx.device, seed=ctx.seed, path=path)
    return tokenizer, model


def training_attention(device: torch.device) -> None:
    """Take cuDNN's SDPA kernel out of this process on a GPU (a trainable role's setup,
    before any forward, so compiled layers trace without it too).

    Its backward returns NaN in dQ on torch >= 2.11 (H100/H200) when an attention mask
    is passed, the sequence length is 64 mod 128, and a query row's log-sum-exp is below
    ~-88.7 (pytorch/pytorch#196678, huggingface/trl#7181). Every padded forward here
    passes a mask, and every left-padded prompt position is a fully masked row
    (log-sum-exp -inf), so any micro-batch group whose width is 64 mod 128 makes the
    whole step's gradient NaN and the trainer skips the update. On an H100 (session 17,
    torch 2.11) both qwen2-1.5b actor updates of bench/actor_profile.py had a NaN gradient
    norm, and the last of their five forwards was 192 positions wide; on the CPU the same
    update is finite. With this switch (session 18, H100) every update of the same
    shapes had a finite norm. SDPA then picks memory-efficient attention for masked
    forwards (flash takes no mask): 140 ms of that update against cuDNN's 67 ms. Packed
    forwards (`attn_implementation: varlen`, models/varlen.py) pass no mask and took
    39 ms. The forwards of a colocated rollout engine or reference in the same process
    lose the cuDNN choice too (their values are unchanged)."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)

"""Forward passes of a transformers Qwen2 / Qwen3 / Llama / Mistral causal LM over the native engine's
slot KV cache, built from the model's OWN modules: embedding, RMSNorms, q/k/v/o
projections (with Qwen2's qkv bias), Qwen3's per-head q/k RMSNorms (applied before RoPE,
as its attention does), MLP, final norm, lm_head and the rotary embedding. Nothing is
translated or copied, so a weight written into the HF model (or aliased from the actor) is
what the next step computes with; only attention-with-cache is written here.

Consumes: token ids and positions; the KV cache (kv_cache.SlotCache, or paged.PagedCache:
the passes write and read K/V only through its `address` / `write` / `read` / `attend`,
so one forward serves both layouts). Produces: next-token logits, float32, one row per
sequence, and writes each token's K/V into its slot at its position.

  prefill  tokens [U, P] right-padded, lengths [U]; rows [R] read prompt group[r] and own
           slot slots[r] (n samples of one prompt share its prefill)      -> logits [U, V]
  extend   tokens [U, A] right-padded, lengths [U], starts [U], slots [U]: continue
           sequences whose slots already hold K/V at positions < starts (a multi-turn
           trajectory's earlier turns): the new tokens sit at starts .. starts+len-1 and
           attend to everything before them                               -> logits [U, V]
  decode   tokens [B], positions [B]; row b owns slot b (the scheduler keeps rows dense)
                                                                          -> logits [B, V]
  prompt_logits  an admission's prompts: fresh ones prefilled, continued ones extended

Invariants: positions start at 0 at a prompt's first real token (as `cumsum(mask) - 1` in
the other backends); a slot's cache is valid at positions < the row's current position,
and anything beyond (prefill padding, stale rows) is masked before it is read and
overwritten before it is unmasked. Only full-attention layers are accepted.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from hybridflow.errors import ConfigError
from hybridflow.stages.rollout.native.forward.fused import FusedDecode, rope, unfusable
from hybridflow.stages.rollout.native.kv_cache import to_device

SUPPORTED_ARCHS = ("qwen2", "qwen3", "llama", "mistral")


def check_supported(model: Any, path: str, max_len: int | None = None) -> None:
    """ConfigError naming `{path}.model` unless `model` is a Qwen2/Qwen3/Llama/Mistral
    causal LM whose layers this engine computes exactly over slots of `max_len` positions
    (Mistral's sliding window never slides within a sequence that short)."""
    cfg = getattr(model, "config", None)
    arch = getattr(cfg, "model_type", None)
    where = f"{path}.model" if path else "model"
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(
            where,
            f"the native rollout engine runs {', '.join(SUPPORTED_ARCHS)} causal LMs; "
            f"this model is {arch!r} ({type(model).__name__}); use the hf backend for it",
        )
    body = getattr(model, "model", None)
    if not all(hasattr(body, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        raise ConfigError(where, f"{type(model).__name__} lacks the {arch} module layout")
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(cfg, "use_sliding_window", False):
        raise ConfigError(
            where, f"sliding-window attention layers are not supported (layer types {kinds})"
        )
    window = getattr(cfg, "sliding_window", None) if arch == "mistral" else None
    if window is not None and (max_len is None or max_len > window):
        raise ConfigError(
            where,
            f"Mistral's sliding window of {window} positions would slide within a slot of "
            f"{max_len} (max_prompt_len + max_new_tokens, rounded up to 16); the native engine "
            "attends to every position: keep slots within the window or use the hf backend",
        )


class NativeModel:
    def __init__(self, hf_model: Any, max_len: int, *, autocast_bf16: bool = False, path: str = ""):
        check_supported(hf_model, path, max_len)
        cfg = hf_model.config
        body = hf_model.model
        self.hf = hf_model
        self.embed = body.embed_tokens
        self.layers = list(body.layers)
        self.norm = body.norm
        self.lm_head = hf_model.lm_head
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = self.layers[0].self_attn.head_dim
        self.groups = self.num_heads // self.num_kv_heads
        # Qwen3 normalises each head's q and k (over head_dim) before RoPE; others do not.
        self.qk_norms = [
            (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None))
            for layer in self.layers
        ]
        self.vocab = self.lm_head.out_features
        self.max_len = max_len
        self.device = self.embed.weight.device
        self.autocast = autocast_bf16
        # K/V are stored in the dtype attention runs in (bf16 under autocast).
        self.dtype = torch.bfloat16 if autocast_bf16 else self.embed.weight.dtype
        self.cols = torch.arange(max_len, device=self.device)  # [L] positions / row ids
        # cos/sin of every position, from the model's own rotary module (its inv_freq and
        # scaling, whatever the RoPE type); HF casts them to the hidden dtype the same way.
        with torch.no_grad():
            probe = torch.zeros(1, device=self.device, dtype=self.embed.weight.dtype)
            cos, sin = body.rotary_emb(probe, self.cols[None, :])
        self.cos, self.sin = cos[0], sin[0]  # [L, D]
        self.fused: FusedDecode | None = None  # decode in few kernels (fused.py), if fuse()d

    def fuse(self, *, compile_fns: bool = False, rope_kernel: bool = False) -> str | None:
        """Take the fused decode path (fused.py) -> None, or why this model cannot."""
        why = unfusable(self.hf)
        if why is None:
            self.fused = FusedDecode(self, compile_fns=compile_fns, rope_kernel=rope_kernel)
        return why

    def unfuse(self) -> None:
        """Back to the module path (e.g. before LoRA wraps the projections); the modules'
        parameters stay views of the merged tensors, which hold their values."""
        self.fused = None

    def refresh_fused(self) -> int:
        """After a weight update: copy replaced parameters into the merged tensors."""
        return 0 if self.fused is None else self.fused.refresh()

    def _qk_norm(
        self, i: int, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's per-head q/k norms (Qwen3; the last dim is head_dim in every view)."""
        q_norm, k_norm = self.qk_norms[i]
        if q_norm is not None:
            q = q_norm(q)
        if k_norm is not None:
            k = k_norm(k)
        return q, k

    def _ctx(self) -> Any:
        if self.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def prefill(
        self,
        tokens: torch.Tensor,  # [U, P] int64, right-padded
        lengths: torch.Tensor,  # [U] int64, >= 1
        writes: tuple[torch.Tensor, Any],  # cache.prompt_writes: (src [N], addresses)
        cache: Any,  # kv_cache.SlotCache or paged.PagedCache
    ) -> torch.Tensor:
        """Run whole prompts, write their K/V where `writes` says (every row's slot at
        positions 0..P-1) -> logits [U, V]."""
        u, p = tokens.shape
        src, at = writes
        cos, sin = self.cos[:p][None, :, None, :], self.sin[:p][None, :, None, :]  # [1,P,1,D]
        with self._ctx():
            x = self.embed(tokens)  # [U, P, H]
            for i, layer in enumerate(self.layers):
                attn = layer.self_attn
                h = layer.input_layernorm(x)
                q = attn.q_proj(h).view(u, p, self.num_heads, self.head_dim)
                k = attn.k_proj(h).view(u, p, self.num_kv_heads, self.head_dim)
                q, k = self._qk_norm(i, q, k)
                q, k = rope(q, cos, sin), rope(k, cos, sin)
                v = attn.v_proj(h).view(u, p, self.num_kv_heads, self.head_dim)
                cache.write(
                    i, at, k.flatten(0, 1)[src].to(self.dtype), v.flatten(0, 1)[src].to(self.dtype)
                )
                # Right padding: a real query (< length) sees only real keys under the
                # causal mask; padded queries compute garbage nobody reads.
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2).to(self.dtype),
                    k.transpose(1, 2).to(self.dtype),
                    v.transpose(1, 2).to(self.dtype),
                    is_causal=True,
                    scale=attn.scaling,
                    enable_gqa=True,
                )  # [U, Hq, P, D]
                x = x + attn.o_proj(o.transpose(1, 2).reshape(u, p, -1))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            last = x[torch.arange(u, device=x.device), lengths - 1]  # [U, H]
            return self.lm_head(self.norm(last)).float()

    def extend(
        self,
        tokens: torch.Tensor,  # [U, A] int64, right-padded new tokens
        lengths: torch.Tensor,  # [U] int64 on the host, >= 1 new tokens per sequence
        starts: torch.Tensor,  # [U] int64 on the host, positions already in each slot (>= 1)
        slots: torch.Tensor,  # [U] int64 on the host, one slot per sequence
        cache: Any,  # kv_cache.SlotCache or paged.PagedCache
    ) -> torch.Tensor:
        """Prefill new tokens on top of a slot's cached positions -> logits [U, V] of each
        sequence's last new token. Only real tokens are written to the cache; a padded
        query attends to the cache like the last real one and its output is not read.

        The index arithmetic runs on the host, where the lengths are: the layer loop never
        waits for the device (a boolean-mask index would, twice per layer). Not measured
        faster on an H200 (bench/RESULTS.md: turn-boundary admissions ~95 ms either way)."""
        u, a = tokens.shape
        dev = self.device
        steps = torch.arange(a)
        real = steps[None, :] < lengths[:, None]  # [U, A]
        n = int((starts + lengths).max())  # positions any query attends to
        flat = real.flatten().nonzero().flatten()  # [N] the real tokens in [U*A] order ...
        wpos = (starts[:, None] + steps[None, :])[real]  # ... their positions ...
        wslot = slots[:, None].expand(u, a)[real]  # ... and slots
        last = torch.arange(u) * a + lengths - 1  # [U] each sequence's last real token
        safe = torch.minimum(starts[:, None] + steps[None, :], (starts + lengths - 1)[:, None])
        flat, wpos, wslot, last, safe, dslots = (
            t.to(dev, non_blocking=True) for t in (flat, wpos, wslot, last, safe, slots)
        )
        at = cache.address(wslot, wpos)
        cos, sin = self.cos[safe][:, :, None, :], self.sin[safe][:, :, None, :]  # [U,A,1,D]
        # query j of sequence u sees cached position c iff c <= starts[u] + j
        mask = (self.cols[None, None, :n] <= safe[:, :, None])[:, None]  # [U, 1, A, n]
        with self._ctx():
            x = self.embed(tokens)  # [U, A, H]
            for i, layer in enumerate(self.layers):
                attn = layer.self_attn
                h = layer.input_layernorm(x)
                q = attn.q_proj(h).view(u, a, self.num_heads, self.head_dim)
                k = attn.k_proj(h).view(u, a, self.num_kv_heads, self.head_dim)
                q, k = self._qk_norm(i, q, k)
                q, k = rope(q, cos, sin), rope(k, cos, sin)
                v = attn.v_proj(h).view(u, a, self.num_kv_heads, self.head_dim)
                cache.write(  # [N, Hkv, D] each
                    i,
                    at,
                    k.flatten(0, 1)[flat].to(self.dtype),
                    v.flatten(0, 1)[flat].to(self.dtype),
                )
                kc, vc = cache.read(i, dslots, n)  # [U, Hkv, n, D]
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2).to(self.dtype),
                    kc,
                    vc,
                    attn_mask=mask,
                    scale=attn.scaling,
                    enable_gqa=True,
                )  # [U, Hq, A, D]
                x = x + attn.o_proj(o.transpose(1, 2).reshape(u, a, -1))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            return self.lm_head(self.norm(x.flatten(0, 1)[last])).float()

    def decode(
        self,
        tokens: torch.Tensor,  # [B] int64
        positions: torch.Tensor,  # [B] int64, where each token sits (its K/V is written there)
        rows: torch.Tensor,  # [B] int64, = arange(B) (a static buffer: no arange per step)
        cache: Any,  # kv_cache.SlotCache or paged.PagedCache, >= B slots; row b uses slot b
        length: int | None = None,  # attend to positions < length (> every row's position)
        out: torch.Tensor | None = None,  # [B, V] float32: write the logits here
    ) -> torch.Tensor:
        """One token per row -> logits [B, V]. Shapes are static given B and `length`
        (CUDA-graph safe). Attention reads the first `length` positions of each slot, not
        all L: the caller guarantees every live row's position is below it (rows past it
        are only graph padding, whose output nobody reads)."""
        b = tokens.shape[0]
        n = cache.max_len if length is None else min(length, cache.max_len)
        if self.fused is not None:
            return self.fused.decode(tokens, positions, rows, cache, n, out)
        cos, sin = self.cos[positions], self.sin[positions]  # [B, D]
        cq, sq = cos[:, None, None, :], sin[:, None, None, :]
        ck, sk = cos[:, None, :], sin[:, None, :]
        # Each row attends to its own slot up to and including its position.
        meta = cache.decode_meta(positions, n, self.dtype)
        at = cache.address(rows, positions)
        with self._ctx():
            x = self.embed(tokens)  # [B, H]
            for i, layer in enumerate(self.layers):
                attn = layer.self_attn
                h = layer.input_layernorm(x)
                # GQA as a batch of Hkv heads with G query "positions" each: no K/V repeat.
                q = attn.q_proj(h).view(b, self.num_kv_heads, self.groups, self.head_dim)
                k = attn.k_proj(h).view(b, self.num_kv_heads, self.head_dim)
                v = attn.v_proj(h).view(b, self.num_kv_heads, self.head_dim)
                q, k = self._qk_norm(i, q, k)
                q, k = rope(q, cq, sq), rope(k, ck, sk)
                cache.write(i, at, k.to(self.dtype), v.to(self.dtype))
                o = cache.attend(i, q.to(self.dtype), meta, attn.scaling)  # [B, Hkv, G, D]
                x = x + attn.o_proj(o.reshape(b, -1))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            logits = self.lm_head(self.norm(x)).float()
            return logits if out is None else out.copy_(logits)


# -- the prompt half of admission ---------------------------------------------------------
# A fresh prompt is prefilled whole, once for its n rows (prefill); a session's continued
# prompt (a multi-turn trajectory's next turn) runs only its new tokens on top of the K/V
# its slot already holds (extend), so the history is never computed twice.
# `prefill_tokens` counts the positions computed, `reused_tokens` the cached positions a
# continued prompt did not recompute (their sum is what re-prefilling costs).


def prompt_logits(
    model: NativeModel,
    cache: Any,  # kv_cache.SlotCache or paged.PagedCache
    prompts: list[torch.Tensor],  # U unique prompts, each [P_u] int64
    cached: list[int],  # [U] positions each one's slot already holds (0: fresh)
    row_slots: list[int],  # [R] the slot of each admitted row
    row_group: list[int],  # [R] the prompt (0..U-1) of each row
    stats: MutableMapping[str, float],
) -> torch.Tensor:
    """Prefill fresh prompts and extend continued ones -> last-token logits [U, V]."""
    dev = model.device
    lengths = torch.tensor([x.numel() for x in prompts], dtype=torch.int64)  # [U]
    out = torch.empty(len(prompts), model.vocab, dtype=torch.float32, device=dev)
    fresh = [i for i, k in enumerate(cached) if k == 0]
    cont = [i for i, k in enumerate(cached) if k > 0]
    if fresh:
        at = {u: j for j, u in enumerate(fresh)}
        rows = [r for r, g in enumerate(row_group) if g in at]
        width = int(lengths[fresh].max())
        tokens = torch.zeros(len(fresh), width, dtype=torch.int64)  # [Uf, P] right-padded
        for j, u in enumerate(fresh):
            tokens[j, : prompts[u].numel()] = prompts[u]
        writes = cache.prompt_writes(
            [row_slots[r] for r in rows],
            [at[row_group[r]] for r in rows],
            [prompts[u].numel() for u in fresh],
            width,
        )
        # rows of `out` by a device index: `out[list]` copies the list to the device
        # synchronously (seen on an H100, session 16), `to_device` does not wait
        out.index_copy_(
            0,
            to_device(fresh, dev),
            model.prefill(to_device(tokens, dev), to_device(lengths[fresh], dev), writes, cache),
        )
        stats["prefill_tokens"] += int(lengths[fresh].sum())
    if cont:  # a session's prompt has one row, in the slot its K/V was moved to
        slot_of = {g: row_slots[r] for r, g in enumerate(row_group)}
        new = [prompts[u][cached[u] :] for u in cont]
        counts = torch.tensor([x.numel() for x in new], dtype=torch.int64)  # [Uc]
        tokens = torch.zeros(len(cont), int(counts.max()), dtype=torch.int64)  # [Uc, A]
        for j, x in enumerate(new):
            tokens[j, : x.numel()] = x
        out.index_copy_(
            0,
            to_device(cont, dev),
            model.extend(
                to_device(tokens, dev),
                counts,
                torch.tensor([cached[u] for u in cont], dtype=torch.int64),
                torch.tensor([slot_of[u] for u in cont], dtype=torch.int64),
                cache,
            ),
        )
        stats["prefill_tokens"] += int(counts.sum())
        stats["reused_tokens"] += sum(cached[u] for u in cont)
    return out

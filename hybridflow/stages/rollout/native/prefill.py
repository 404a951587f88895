"""The prompt half of admission: the positions a newly admitted prompt puts in its slots.

A fresh prompt is prefilled whole, once for its n rows (NativeModel.prefill); a session's
continued prompt (a multi-turn trajectory's next turn) runs only its new tokens on top of
the K/V its slot already holds (NativeModel.extend), so the history is never computed
twice. Both return the logits that sample each row's first token.

Invariant: `prefill_tokens` counts the positions computed, `reused_tokens` the cached
positions a continued prompt did not recompute (their sum is what re-prefilling costs).
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from hybridflow.stages.rollout.native.model import NativeModel


def prompt_logits(
    model: NativeModel,
    kv: torch.Tensor,  # [layers, 2, S, Hkv, L, D]
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
        out[fresh] = model.prefill(
            tokens.to(dev),
            lengths[fresh].to(dev),
            torch.tensor([row_slots[r] for r in rows], dtype=torch.int64, device=dev),
            torch.tensor([at[row_group[r]] for r in rows], dtype=torch.int64, device=dev),
            kv,
        )
        stats["prefill_tokens"] += int(lengths[fresh].sum())
    if cont:  # a session's prompt has one row, in the slot its K/V was moved to
        slot_of = {g: row_slots[r] for r, g in enumerate(row_group)}
        new = [prompts[u][cached[u] :] for u in cont]
        counts = torch.tensor([x.numel() for x in new], dtype=torch.int64)  # [Uc]
        tokens = torch.zeros(len(cont), int(counts.max()), dtype=torch.int64)  # [Uc, A]
        for j, x in enumerate(new):
            tokens[j, : x.numel()] = x
        out[cont] = model.extend(
            tokens.to(dev),
            counts.to(dev),
            torch.tensor([cached[u] for u in cont], dtype=torch.int64, device=dev),
            torch.tensor([slot_of[u] for u in cont], dtype=torch.int64, device=dev),
            kv,
        )
        stats["prefill_tokens"] += int(counts.sum())
        stats["reused_tokens"] += sum(cached[u] for u in cont)
    return out

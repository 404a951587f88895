"""Prompt/SFT items -> the tensor batches that cross the Role seam, and back.

Batch layout (field names are the dataflow's; every tensor has the batch dim first):
  prompt_ids      [B, P] int64   left-padded with the tokenizer's pad id
  prompt_mask     [B, P] int64   1 = real token, 0 = padding
  response_ids    [B, R] int64   right-padded (SFT batches; rollout produces them in RL)
  response_mask   [B, R] int64
  metadata_json   [B, L] uint8   each row: the sample's metadata as UTF-8 JSON, 0-padded

Metadata travels as bytes because messages only carry tensors and scalars; JSON (never
pickle) keeps it safe to decode from a socket. A JSON text never contains a 0 byte
(NUL is escaped as \\u0000), so trailing zeros are unambiguous padding.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hybridflow.data.prompts import PromptItem


def pad_left(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [B, max_len] int64 left-padded with `pad_id`, mask [B, max_len] int64."""
    return _pad(rows, pad_id, left=True)


def pad_right(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [B, max_len] int64 right-padded with `pad_id`, mask [B, max_len] int64."""
    return _pad(rows, pad_id, left=False)


def _pad(
    rows: Sequence[Sequence[int]], pad_id: int, left: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, r in enumerate(rows):
        if not r:
            continue
        sl = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, sl] = torch.as_tensor(list(r), dtype=torch.int64)
        mask[i, sl] = 1
    return ids, mask


def unpad(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """ids [B, T], mask [B, T] -> per row, the ids where mask is nonzero (order kept)."""
    return [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu(), strict=True)]


def encode_metadata(metadata: Sequence[dict[str, Any]]) -> torch.Tensor:
    """Per-sample dicts -> metadata_json [B, L] uint8 (L >= 1)."""
    blobs = [json.dumps(m, ensure_ascii=False, separators=(",", ":")).encode() for m in metadata]
    width = max((len(b) for b in blobs), default=1)
    out = torch.zeros((len(blobs), max(width, 1)), dtype=torch.uint8)
    for i, b in enumerate(blobs):
        out[i, : len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8)
    return out


def decode_metadata(t: torch.Tensor) -> list[dict[str, Any]]:
    """metadata_json [B, L] uint8 -> per-sample dicts. Raises ValueError on bad rows."""
    if t.dtype != torch.uint8 or t.dim() != 2:
        raise ValueError(f"metadata_json must be uint8 [B, L], got {t.dtype} {tuple(t.shape)}")
    out = []
    for i, row in enumerate(t.cpu()):
        raw = bytes(row.numpy().tobytes()).rstrip(b"\0")
        try:
            value = json.loads(raw.decode()) if raw else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"metadata_json row {i} is not UTF-8 JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError(f"metadata_json row {i} is not a JSON object")
        out.append(value)
    return out


def collate_prompts(items: Sequence[PromptItem], pad_id: int) -> dict[str, torch.Tensor]:
    """Prompt items -> {prompt_ids [B, P], prompt_mask [B, P], metadata_json [B, L]}."""
    ids, mask = pad_left([it.prompt_ids for it in items], pad_id)
    return {
        "prompt_ids": ids,
        "prompt_mask": mask,
        "metadata_json": encode_metadata([it.metadata for it in items]),
    }


def collate_sft(examples: Sequence[Mapping[str, Any]], tokenizer: Any) -> dict[str, torch.Tensor]:
    """{prompt, response} pairs -> prompt_ids/prompt_mask [B, P] (left-padded) and
    response_ids/response_mask [B, R] (right-padded, EOS appended): the RL batch layout,
    so an SFT step is the actor's `sft_update` on the same tensors.

    A pair's prompt is a string (tokenized here, as a plain prompt: special tokens
    added) or already token ids under `prompt_ids` (the sft source gives the RL prompt
    source's ids, chat template applied: data/prompts.py `make_item`). A response is a
    string (tokenized, EOS appended) or already token ids under `response_ids`, taken as
    they are, with an optional `response_mask` (1: trained on; 0: not, e.g. the tool
    observations inside a multi-turn demonstration; its last entry must be 1)."""
    prompts = [
        list(e["prompt_ids"])
        if "prompt_ids" in e
        else tokenizer(e["prompt"], add_special_tokens=True)["input_ids"]
        for e in examples
    ]
    responses = [
        list(e["response_ids"])
        if "response_ids" in e
        else tokenizer(e["response"], add_special_tokens=False)["input_ids"]
        + [tokenizer.eos_token_id]
        for e in examples
    ]
    p_ids, p_mask = pad_left(prompts, tokenizer.pad_token_id)
    r_ids, r_mask = pad_right(responses, tokenizer.pad_token_id)
    for i, e in enumerate(examples):  # a multi-turn response: 0 on its observation tokens
        if e.get("response_mask") is not None:
            r_mask[i, : len(responses[i])] = torch.as_tensor(list(e["response_mask"]))
    return {
        "prompt_ids": p_ids,
        "prompt_mask": p_mask,
        "response_ids": r_ids,
        "response_mask": r_mask,
    }


def row_metadata(
    batch: dict[str, torch.Tensor], b: int, exclude: Sequence[str]
) -> list[dict[str, Any]]:
    """Per sample: its decoded `metadata_json` record (or {}) plus the value of every other
    [B]-shaped tensor of the batch not named in `exclude`. Raises ValueError."""
    if "metadata_json" in batch:
        rows = decode_metadata(batch["metadata_json"])
        if len(rows) != b:
            raise ValueError(f"metadata_json has {len(rows)} rows, B = {b}")
    else:
        rows = [{} for _ in range(b)]
    for key, t in batch.items():
        if key not in exclude and t.dim() == 1 and t.shape[0] == b:
            for row, value in zip(rows, t.tolist(), strict=True):
                row[key] = value
    return rows

"""The `prompts` data source: prompt datasets for RL, each prompt repeated for its group.

GRPO-family estimators compare the n samples of one prompt. The runtime streams
*samples*, so this source lays a step out as groups: every prompt is repeated
`samples_per_prompt` (n) times on consecutive rows, and the rollout samples each row
once. `run.step_batch` and `run.micro_batch` count samples; a step holds
step_batch / n prompts, and a micro-batch holds whole groups when micro_batch % n == 0
(the `advantages` driver op insists on it for group estimators).

Fields it can provide (B = rows = samples):
  prompt_ids     [B, P] int64   left-padded (rows i*n .. i*n+n-1 are one prompt)
  prompt_mask    [B, P] int64
  metadata_json  [B, L] uint8   the record's other fields (e.g. `answer`, `id`)
  group_index    [B] int64      global prompt number: step * (B / n) + i, shared by a group
  sample_idx     [B] int64      global sample number: step * B + row

Options: `samples_per_prompt` (default 1) and every option of
`hybridflow.pipeline.sources.prompt_source.PromptSource` (source, tokenizer or model, task_size, ...).

Invariant: deterministic in (seed, step), like PromptSource underneath: prompt k of the
run is the same whatever n is, so GRPO and PPO presets over one dataset see the same
prompts in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybridflow.config.fields import GROUP_INDEX, METADATA, PROMPT_FIELDS, SAMPLE_INDEX
from hybridflow.errors import ConfigError, PipelineError
from hybridflow.pipeline.sources.registry import check_fields

Batch = dict[str, torch.Tensor]
_PER_PROMPT = (*PROMPT_FIELDS, METADATA)  # what the inner PromptSource gives, once a prompt


class GroupedPrompts:
    FIELDS = (*_PER_PROMPT, GROUP_INDEX, SAMPLE_INDEX)

    def __init__(self, fields: tuple[str, ...], options: Mapping[str, Any], seed: int) -> None:
        from hybridflow.pipeline.sources.prompt_source import PromptSource

        check_fields(fields, self.FIELDS, "prompts")
        opts = dict(options)
        n = opts.pop("samples_per_prompt", 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError("data.options.samples_per_prompt", f"must be an int >= 1, got {n!r}")
        self.n = n
        self.fields = fields
        # at least prompt_ids: the inner source counts its rows by a field
        inner = tuple(f for f in _PER_PROMPT if f in fields) or PROMPT_FIELDS[:1]
        self.inner = PromptSource(inner, opts, seed)
        self.tokenizer = self.inner.tokenizer

    def prompt_count(self) -> int | None:
        """Prompts in one epoch of the dataset; None for a stream (it has no length)."""
        return self.inner.prompt_count()

    def batch(self, step: int, size: int) -> Batch:
        if size % self.n:
            raise PipelineError(
                f"prompts source: {size} samples per step is not a multiple of "
                f"data.options.samples_per_prompt {self.n}"
            )
        prompts = size // self.n
        rows = self.inner.batch(step, prompts)
        out = {k: v.repeat_interleave(self.n, dim=0) for k, v in rows.items()}
        out[GROUP_INDEX] = torch.arange(
            step * prompts, (step + 1) * prompts, dtype=torch.int64
        ).repeat_interleave(self.n)
        out[SAMPLE_INDEX] = torch.arange(step * size, (step + 1) * size, dtype=torch.int64)
        return {name: out[name] for name in self.fields}

    def close(self) -> None:
        self.inner.close()

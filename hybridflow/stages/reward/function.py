"""The `function` reward backend: a Python function, named `package.module:function`.

The function's documented, batched signature (one call per micro-batch):

    fn(prompts: list[str], responses: list[str],
       prompt_ids: list[list[int]], response_ids: list[list[int]],
       metadata: list[dict]) -> list[float]          # one finite number per sample

  prompts / responses   decoded with the tokenizer, special tokens skipped (the prompt as
                        the model saw it, chat template included)
  prompt_ids / ...      the real tokens only (padding removed)
  metadata              per sample: the `metadata_json` row (the dataset record's other
                        fields, e.g. `answer`, `id`, `index`), plus every other [B]-shaped
                        tensor of the batch under its name (e.g. `group_index`)

Op:
  score   prompt_ids [B, P], response_ids [B, R]; optional prompt_mask / response_mask
          (default: every position is real) and metadata_json [B, L] uint8
      ->  rewards [B] float32;  metrics reward/fn_s (seconds in the function)

Options: function (required), tokenizer ("builtin" or a directory), or model (the
tokenizer of that model directory / preset); one of tokenizer/model is required.

Invariants: the function is imported with importlib (never eval); if the batched call
raises, the samples are re-run one by one to name the first failing one, and a
RewardFunctionError names the function, the row and the sample id; a wrong count or a
NaN/inf/non-number is a RewardFunctionError too. Never a silent zero.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.config.imports import load_attr, split_spec
from hybridflow.config.loader import from_dict
from hybridflow.data.batching import row_metadata, unpad
from hybridflow.errors import BatchError, ConfigError, RewardFunctionError
from hybridflow.models.loader import load_tokenizer
from hybridflow.stages.base import Batch, Metrics, Params, StageContext
from hybridflow.stages.common import options_path
from hybridflow.stages.contract import RoleBase, op

RewardFn = Callable[..., Any]
_TEXT_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "metadata_json")


@dataclass
class FunctionRewardOptions:
    function: str = ""  # package.module:function
    tokenizer: str | None = None  # "builtin" or a tokenizer directory
    model: str | None = None  # or: use this model's tokenizer

    def validate(self, path: str) -> None:
        split_spec(self.function, f"{path}.function", form="package.module:function")
        if self.tokenizer is None and self.model is None:
            raise ConfigError(
                f"{path}.tokenizer",
                "is required to decode text: 'builtin', a tokenizer directory, or set `model`",
            )


class FunctionReward(RoleBase):
    """Registered as ("reward", "function")."""

    options_cls = FunctionRewardOptions  # checked at plan time too (pipeline/compiler/plan.py)

    def __init__(self) -> None:
        self.fn: RewardFn | None = None
        self.name = ""

    def setup(self, ctx: StageContext) -> None:
        path = options_path(ctx)
        opts = from_dict(FunctionRewardOptions, dict(ctx.options), path)
        self.name = opts.function
        self.fn = load_attr(opts.function, f"{path}.function", callable_only=True)
        self.tokenizer = load_tokenizer(opts.tokenizer, opts.model, f"{path}.tokenizer")

    @op(name="score", inputs=("prompt_ids", "response_ids"), outputs=("rewards",))
    def _op_score(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """One reward per row from the user's function."""
        args = self._arguments(batch)
        t0 = time.perf_counter()
        rewards = self.score(*args)
        return {"rewards": rewards}, {"reward/fn_s": time.perf_counter() - t0}

    def _arguments(self, batch: Batch) -> tuple[list[str], list[str], list, list, list[dict]]:
        where = "reward function score"
        for key in ("prompt_ids", "response_ids"):
            if key not in batch:
                raise BatchError(f"{where}: batch lacks {key!r}; it has {sorted(batch)}")
        b = batch["prompt_ids"].shape[0]
        ids = {}
        for key in ("prompt", "response"):
            t = batch[f"{key}_ids"]
            mask = batch.get(f"{key}_mask", torch.ones_like(t))
            if t.dim() != 2 or t.shape != mask.shape or t.shape[0] != b:
                raise BatchError(
                    f"{where}: {key}_ids {tuple(t.shape)} / {key}_mask {tuple(mask.shape)} "
                    f"must be [B, T] with B = {b}"
                )
            ids[key] = unpad(t, mask)
        try:
            metadata = row_metadata(batch, b, exclude=_TEXT_FIELDS)
        except ValueError as exc:
            raise BatchError(f"{where}: {exc}") from exc
        decode = self.tokenizer.batch_decode
        prompts = decode(ids["prompt"], skip_special_tokens=True)
        responses = decode(ids["response"], skip_special_tokens=True)
        return prompts, responses, ids["prompt"], ids["response"], metadata

    def score(
        self,
        prompts: list[str],
        responses: list[str],
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
        metadata: list[dict[str, Any]],
    ) -> torch.Tensor:
        """Call the function on a batch -> rewards [B] float32, or RewardFunctionError."""
        assert self.fn is not None
        try:
            out = self.fn(prompts, responses, prompt_ids, response_ids, metadata)
        except Exception as exc:
            self._blame(prompts, responses, prompt_ids, response_ids, metadata, exc=exc)
        return self._check(out, metadata)

    def _blame(self, *args: list[Any], exc: Exception) -> None:
        """Re-run sample by sample to name the first failing sample, then raise."""
        metadata = args[-1]
        for i in range(len(metadata)):
            try:
                self.fn(*[[a[i]] for a in args])  # type: ignore[misc]
            except Exception as sample_exc:
                raise RewardFunctionError(
                    f"reward function {self.name} raised on sample {i} "
                    f"(id {_sample_id(metadata, i)}): {type(sample_exc).__name__}: {sample_exc}",
                    function=self.name,
                    sample=i,
                ) from sample_exc
        raise RewardFunctionError(
            f"reward function {self.name} raised on a batch of {len(metadata)} samples "
            f"(each sample alone succeeds): {type(exc).__name__}: {exc}",
            function=self.name,
        ) from exc

    def _check(self, out: Any, metadata: list[dict[str, Any]]) -> torch.Tensor:
        b = len(metadata)
        if isinstance(out, torch.Tensor):
            out = out.detach().cpu().reshape(-1).tolist() if out.dim() <= 1 else out
        try:
            values = list(out)
        except TypeError:
            raise RewardFunctionError(
                f"reward function {self.name} returned {type(out).__name__}, expected a "
                f"list of {b} floats",
                function=self.name,
            ) from None
        if len(values) != b:
            raise RewardFunctionError(
                f"reward function {self.name} returned {len(values)} values for {b} samples",
                function=self.name,
            )
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise RewardFunctionError(
                    f"reward function {self.name} returned {v!r} for sample {i} "
                    f"(id {_sample_id(metadata, i)}); expected a finite number",
                    function=self.name,
                    sample=i,
                )
        return torch.tensor([float(v) for v in values], dtype=torch.float32)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        self.fn = None


def _sample_id(metadata: list[dict[str, Any]], i: int) -> str:
    return str(metadata[i].get("id", metadata[i].get("index", f"row {i}")))

"""The `function` reward backend: a Python function, named `package.module:function`,
or a built-in verifier named by `scorer:` (hybridflow.reward.scorers).

Two signatures, told apart by the parameter names (`style: auto`) or forced by `style`:

batched (one call per micro-batch):
    fn(prompts: list[str], responses: list[str],
       prompt_ids: list[list[int]], response_ids: list[list[int]],
       metadata: list[dict]) -> list[float]          # one finite number per sample

  prompts / responses   decoded with the tokenizer, special tokens skipped (the prompt as
                        the model saw it, chat template included)
  prompt_ids / ...      the real tokens only (padding removed)
  metadata              per sample: the `metadata_json` row (the dataset record's other
                        fields, e.g. `answer`, `id`, `index`), plus every other [B]-shaped
                        tensor of the batch under its name (e.g. `group_index`)

per sample (verl's `compute_score`, unchanged: a verl job's reward file plugs in as is):
    fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

  data_source    the record's `data_source` ("" when it has none)
  solution_str   the decoded response
  ground_truth   the record's value at `ground_truth_key` (default
                 `reward_model.ground_truth`, verl's layout; a dotted path)
  extra_info     the record's `extra_info` ({} when it has none)
  A dict result's `score` is the reward; its other numeric keys become metrics
  `reward/<key>` (mean over the micro-batch's samples, then the step's), and every
  extra (numbers and strings such as a scorer's `pred`) travels per sample in
  `reward_info`, which validation reads for per-source accuracy and majority votes.
  Calls run concurrently (`max_workers`), each bounded by `timeout_s`; `async def`
  functions are awaited concurrently (stages/reward/per_sample.py).

Op:
  score   prompt_ids [B, P], response_ids [B, R]; optional prompt_mask / response_mask
          (default: every position is real) and metadata_json [B, L] uint8
      ->  rewards [B] float32; reward_info [B, L] uint8 (per sample: the extras as UTF-8
          JSON, 0-padded; `{}` for the batched style)
          metrics reward/fn_s (seconds in the function); per sample also
          reward/fn_failures, reward/fn_timeout_count and reward/<extra key>

Options: function or scorer (one of them), style (auto | batched | per_sample),
ground_truth_key, timeout_s (30), max_workers (8), failure_score (0.0; null: a failing
sample ends the run), tokenizer ("builtin" or a directory) or model (the tokenizer of
that model directory / preset); one of tokenizer/model is required.

Failures (never a silent zero): values are checked in one place
(hybridflow/reward/values.py: finite float32 numbers; a dict is only a per-sample
result). Batched: if the call raises, the samples are re-run one by one to name the
first failing one, and a RewardFunctionError names the function, the row and the sample
id; a wrong count or a bad value is a RewardFunctionError too. Per sample: a call that
raises, times out or returns a bad value gets `failure_score` and is logged by name
(function, sample id, cause) and counted in reward/fn_failures, so one pathological
input does not lose the step's other rewards; if every sample of a call fails the
function is broken and a RewardFunctionError ends the run. A record without the ground
truth key is a data error, named by row and key. The function is imported with
importlib (never eval).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hybridflow.config.fields import METADATA, SEQUENCE_FIELDS
from hybridflow.config.imports import load_attr, split_spec
from hybridflow.config.loader import from_dict
from hybridflow.data.batching import encode_metadata, row_metadata, unpad
from hybridflow.errors import BatchError, ConfigError, RewardFunctionError
from hybridflow.models.loader import load_tokenizer
from hybridflow.reward.values import BadReward, reward_list, reward_number
from hybridflow.stages.base import Batch, Metrics, Params, StageContext
from hybridflow.stages.common import options_path
from hybridflow.stages.contract import RoleBase, op
from hybridflow.stages.reward.per_sample import Outcome, PerSampleCaller, is_per_sample

log = logging.getLogger("hybridflow.reward.function")

RewardFn = Callable[..., Any]
_TEXT_FIELDS = (*SEQUENCE_FIELDS, METADATA)
# Metric names the reward op's extras may not take (they are the driver's reward stats).
_RESERVED_EXTRAS = ("mean", "sq_mean", "std", "max", "min", "fn_s", "fn_failures")
_LOGGED_FAILURES = 3  # failing samples named per call; the rest are counted


@dataclass
class FunctionRewardOptions:
    function: str = ""  # package.module:function
    scorer: str = ""  # or: a built-in verifier by name (hybridflow.reward.scorers)
    style: Literal["auto", "batched", "per_sample"] = "auto"  # auto: from the signature
    ground_truth_key: str = "reward_model.ground_truth"  # per sample: dotted path in a record
    timeout_s: float = 30.0  # per sample: one call's deadline
    max_workers: int = 8  # per sample: calls in flight at once
    failure_score: float | None = 0.0  # per sample: a failing call's reward; None: fail
    tokenizer: str | None = None  # "builtin" or a tokenizer directory
    model: str | None = None  # or: use this model's tokenizer

    def validate(self, path: str) -> None:
        if bool(self.function) == bool(self.scorer):
            raise ConfigError(
                f"{path}.function",
                "give exactly one of `function` (package.module:function) and `scorer` "
                "(a built-in verifier: gsm8k, math, countdown, default)",
            )
        if self.scorer:
            from hybridflow.reward.scorers import scorer_target

            scorer_target(self.scorer, f"{path}.scorer")
        else:
            split_spec(self.function, f"{path}.function", form="package.module:function")
        if self.tokenizer is None and self.model is None:
            raise ConfigError(
                f"{path}.tokenizer",
                "is required to decode text: 'builtin', a tokenizer directory, or set `model`",
            )
        if not 0 < self.timeout_s < float("inf"):
            raise ConfigError(f"{path}.timeout_s", f"must be > 0 seconds, got {self.timeout_s}")
        if not 1 <= self.max_workers <= 256:
            raise ConfigError(f"{path}.max_workers", f"must be in 1..256, got {self.max_workers}")
        if not self.ground_truth_key or any(not p for p in self.ground_truth_key.split(".")):
            raise ConfigError(
                f"{path}.ground_truth_key",
                f"must be a dotted key such as reward_model.ground_truth, got "
                f"{self.ground_truth_key!r}",
            )
        if self.failure_score is not None:
            try:
                reward_number(self.failure_score)
            except BadReward as exc:
                raise ConfigError(f"{path}.failure_score", str(exc)) from None

    def target(self, path: str) -> str:
        if self.scorer:
            from hybridflow.reward.scorers import scorer_target

            return scorer_target(self.scorer, f"{path}.scorer")
        return self.function


class FunctionReward(RoleBase):
    """Registered as ("reward", "function")."""

    options_cls = FunctionRewardOptions  # checked at plan time too (pipeline/plan/planner.py)

    def __init__(self) -> None:
        self.fn: RewardFn | None = None
        self.name = ""
        self.caller: PerSampleCaller | None = None  # set for the per-sample signature

    def setup(self, ctx: StageContext) -> None:
        path = options_path(ctx)
        opts = from_dict(FunctionRewardOptions, dict(ctx.options), path)
        self.opts = opts
        self.name = opts.target(path)
        self.fn = load_attr(self.name, f"{path}.function", callable_only=True)
        per_sample = opts.style == "per_sample" or (opts.style == "auto" and is_per_sample(self.fn))
        if per_sample:
            self.caller = PerSampleCaller(
                self.fn, self.name, timeout_s=opts.timeout_s, max_workers=opts.max_workers
            )
        self.tokenizer = load_tokenizer(opts.tokenizer, opts.model, f"{path}.tokenizer")

    @op(name="score", inputs=("prompt_ids", "response_ids"), outputs=("rewards", "reward_info"))
    def _op_score(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """One reward per row from the user's function (and its extras per row)."""
        args = self._arguments(batch)
        t0 = time.perf_counter()
        if self.caller is not None:
            rewards, infos, metrics = self.score_per_sample(args[1], args[4])
        else:
            rewards, infos, metrics = self.score(*args), [{} for _ in args[4]], {}
        metrics["reward/fn_s"] = time.perf_counter() - t0
        return {"rewards": rewards, "reward_info": encode_metadata(infos)}, metrics

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
        try:
            values = reward_list(out, len(metadata))
        except BadReward as exc:
            what = exc.why
            if exc.index >= 0:
                what = (
                    f"{exc.value} for sample {exc.index} "
                    f"(id {_sample_id(metadata, exc.index)}); {exc.why}"
                )
            raise RewardFunctionError(
                f"reward function {self.name} returned {what}",
                function=self.name,
                sample=exc.index if exc.index >= 0 else None,
            ) from None
        return torch.tensor(values, dtype=torch.float32)

    def score_per_sample(
        self, responses: list[str], metadata: list[dict[str, Any]]
    ) -> tuple[torch.Tensor, list[dict[str, Any]], Metrics]:
        """verl's signature, one call per sample -> rewards [B] float32, per-sample
        extras, metrics (see the module docstring for the failure rules)."""
        assert self.caller is not None
        calls = [
            {
                "data_source": str(meta.get("data_source", "")),
                "solution_str": text,
                "ground_truth": self._ground_truth(meta, i),
                "extra_info": meta.get("extra_info") or {},
            }
            for i, (text, meta) in enumerate(zip(responses, metadata, strict=True))
        ]
        outcomes = self.caller.run(calls)
        failed = [i for i, o in enumerate(outcomes) if not o.ok]
        if failed:
            self._report_failures(outcomes, failed, metadata)
        fallback = self.opts.failure_score or 0.0
        rewards = [o.score if o.score is not None else fallback for o in outcomes]
        infos: list[dict[str, Any]] = [dict(o.extras) for o in outcomes]
        metrics: Metrics = {
            "reward/fn_failures": float(len(failed)),
            "reward/fn_timeout_count": float(sum(o.timed_out for o in outcomes)),
        }
        sums: dict[str, list[float]] = {}
        for o in outcomes:
            for key, v in o.extras.items():
                if isinstance(v, float):
                    sums.setdefault(key, []).append(v)
        for key, vs in sums.items():
            name = f"extra_{key}" if key in _RESERVED_EXTRAS else key
            metrics[f"reward/{name}"] = sum(vs) / len(vs)
        return torch.tensor(rewards, dtype=torch.float32), infos, metrics

    def _ground_truth(self, meta: dict[str, Any], i: int) -> Any:
        """The record's value at `ground_truth_key`; a missing key is a data error."""
        value: Any = meta
        for part in self.opts.ground_truth_key.split("."):
            if not isinstance(value, dict) or part not in value:
                row = meta.get("index", f"{i} of the micro-batch")
                raise RewardFunctionError(
                    f"reward function {self.name}: dataset row {row} (id "
                    f"{_sample_id([meta], 0)}) has no "
                    f"{self.opts.ground_truth_key!r} (its fields: {sorted(meta)}); set the "
                    "reward's options.ground_truth_key to where the record keeps the answer",
                    function=self.name,
                    sample=i,
                )
            value = value[part]
        return value

    def _report_failures(
        self, outcomes: list[Outcome], failed: list[int], metadata: list[dict[str, Any]]
    ) -> None:
        """Name the failing samples; raise when failures are fatal (failure_score null, or
        every sample failed: the function is broken, not one input pathological)."""
        first = failed[0]
        cause = (
            f"reward function {self.name} failed on sample {first} "
            f"(id {_sample_id(metadata, first)}): {outcomes[first].error}"
        )
        if self.opts.failure_score is None or len(failed) == len(outcomes):
            why = (
                "" if self.opts.failure_score is None else f" (all {len(outcomes)} samples failed)"
            )
            raise RewardFunctionError(cause + why, function=self.name, sample=first)
        for i in failed[:_LOGGED_FAILURES]:
            log.warning(
                "reward function %s failed on sample %d (id %s): %s; reward %g (failure_score)",
                self.name,
                i,
                _sample_id(metadata, i),
                outcomes[i].error,
                self.opts.failure_score,
            )
        if len(failed) > _LOGGED_FAILURES:
            log.warning(
                "reward function %s: %d more failing samples in this micro-batch "
                "(reward/fn_failures counts them)",
                self.name,
                len(failed) - _LOGGED_FAILURES,
            )

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        self.fn = None


def _sample_id(metadata: list[dict[str, Any]], i: int) -> str:
    return str(metadata[i].get("id", metadata[i].get("index", f"row {i}")))

"""What the rollout backends (hf, vllm, native) share: the sampling options every backend
accepts, per-call sampling overrides, the generate metrics and the checkpoint state.

Every backend's options dataclass extends `HFRolloutOptions` (the name stays for configs
and code that import it); every backend class mixes in `RolloutState`.

Multi-turn options (the trajectory loop, multiturn.py; ignored while `env` is ""):

    env: guess_number            # or package.module:Class; "" = single turn (unchanged)
    env_options: {max_turns: 7}  # keyword arguments of the environment's class
    max_turns: 8                 # model turns per trajectory at most
    max_total_tokens: 0          # prompt + every turn + observations; 0: the model's positions
    env_timeout_s: 60            # bound of one reset / step / close call
    env_concurrency: 32          # environment calls in flight at once (per generate call)
    tool_parser: ""              # passed to the environment as its `parser` option; "": its own
    env_process: false           # true: the environment runs in a process of its own, served
                                 # to this stage over loopback ZeroMQ (env/service/process.py)

A backend runs environments only when its class says so (`runs_environments`); the
others refuse a generate call with `env` set instead of silently running one turn.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from hybridflow.config.fields import GENERATE_INPUTS as GENERATE_INPUTS
from hybridflow.errors import BatchError, ConfigError
from hybridflow.models.loader import ModelOptions
from hybridflow.stages.base import Batch, Metrics, Params
from hybridflow.stages.common import check_ids_mask, check_left_padded, mix_seed
from hybridflow.stages.contract import Scope, op
from hybridflow.stages.env.parsers import get_parser
from hybridflow.stages.env.registry import EnvConfig
from hybridflow.stages.rollout.weights import WeightSink


@dataclass
class HFRolloutOptions(ModelOptions):
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64  # response tokens per sample, at most (the turn's, multi-turn)
    n: int = 1  # samples per prompt (GRPO group size)
    stop_on_eos: bool = True  # a row ends at its first EOS id (False: at max_new_tokens)
    eos_token_id: int | None = None  # None: the tokenizer's and generation_config's EOS ids
    pad_token_id: int | None = None  # None: the tokenizer's pad id
    seed: int | None = None  # None: the run seed
    max_batch_size: int = 0  # rows generated together (0: the whole micro-batch)
    # hf only (the native and vllm engines batch continuously). > 0: the first generate
    # call of a round waits this long for the calls sent with it, and all of them run as
    # one forward loop (rollout/merge.py), as do calls queued behind a running one; faster
    # (2: the CPU GRPO step 0.85-0.9x -> 0.97-0.99x TRL, bench/RESULTS.md), but which calls
    # share a loop depends on arrival times, and a wider batch rounds differently, so runs
    # (and resumes) are no longer bit-identical. 0: every call alone, in arrival order
    merge_window_ms: float = 0.0
    # hf only: the micro-batches the coordinator sends together (one op, one step, this
    # replica, one scheduling round: a "gang", Task params mb_gang) decode as one forward
    # loop, ordered by mb_id. The batch follows from the schedule, not from arrival times,
    # so runs and resumes stay bit-identical (to each other; not to runs without it: a
    # wider batch rounds differently). None: on the CPU only (on a GPU a gang's rows share
    # one loop's KV cache, which a micro_batch sized to the GPU's memory may not fit;
    # `max_batch_size` bounds the rows of a loop); True: on any device; False: never
    merge_gangs: bool | None = None
    # multi-turn (module docstring); every one is ignored while `env` is ""
    env: str = ""
    env_options: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 8
    max_total_tokens: int = 0
    env_timeout_s: float = 60.0
    env_concurrency: int = 32
    tool_parser: str = ""
    env_process: bool = False

    def validate(self, path: str) -> None:
        ModelOptions.validate(self, path)

        def bad(key: str, msg: str) -> ConfigError:
            return ConfigError(f"{path}.{key}" if path else key, msg)

        self._validate_env(path, bad)

        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise bad("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise bad("n", f"must be >= 1, got {self.n}")
        if self.temperature == 0 and self.n > 1:
            raise bad("n", f"greedy decoding (temperature 0) gives {self.n} identical samples")
        if not 0 <= self.merge_window_ms <= 1000:
            raise bad("merge_window_ms", f"must be in [0, 1000] ms, got {self.merge_window_ms}")

    def _validate_env(self, path: str, bad: Any) -> None:
        """The multi-turn keys: syntax and names only (the environment's class is not
        imported here, at plan time; the stage's setup loads it)."""
        EnvConfig(self.env, self.env_options).validate(path)
        if self.max_turns < 1:
            raise bad("max_turns", f"must be >= 1, got {self.max_turns}")
        if self.max_total_tokens < 0:
            raise bad("max_total_tokens", "must be >= 0 (0: the model's positions)")
        if not 0 < self.env_timeout_s < float("inf"):
            raise bad("env_timeout_s", f"must be > 0 seconds, got {self.env_timeout_s}")
        if self.env_concurrency < 1:
            raise bad("env_concurrency", f"must be >= 1, got {self.env_concurrency}")
        if self.env_process and self.env == "remote":
            raise bad("env_process", "env remote is already served elsewhere: drop env_process")
        if self.tool_parser:
            get_parser(self.tool_parser, f"{path}.tool_parser" if path else "tool_parser")
            if "parser" in self.env_options:
                raise bad(
                    "tool_parser",
                    "is set and env_options.parser too: name the parser once",
                )


SAMPLING_OVERRIDES = ("temperature", "top_p", "top_k", "max_new_tokens", "n")


# The `load_weights` op's params. last/version: set per bucket by the stage host;
# sync_timeout_s and stage_weights: the weight link's settings, read by the host
# (pipeline/host/weight_sync.py).
LOAD_WEIGHTS_PARAMS = ("last", "version", "sync_timeout_s", "stage_weights")


class RolloutState:
    """What the rollout backends (hf, vllm, native) share: per-call sampling overrides, the
    generate metrics, weight updates (the `load_weights` op, `update_weights` and
    `load_bucket`, through the backend's `WeightSink`: weights.py), and the checkpoint
    state (the number of generate calls and the policy version loaded). Weights belong to
    the actor; a resumed run reshards before its first rollout, so they are not part of
    it."""

    backend_name: str
    # Whether `generate` runs the trajectory loop when `env` is set (multiturn.py).
    runs_environments: ClassVar[bool] = False
    receives_weights: ClassVar[bool] = True  # a capability (stages/contract.py)
    # `hold_adapters(lora, seed)`: the model can hold a LoRA actor's adapters unmerged and
    # take adapter-only syncs (rollout/adapters.py; the actor's `lora_sync: adapters`).
    takes_adapters: ClassVar[bool] = False
    opts: Any  # the backend's options (an HFRolloutOptions or subclass), set in setup
    seed: int  # the run's (or options.seed), set in setup
    calls: int
    policy_version: int | None
    weights: WeightSink | None  # set in setup, None after close

    @op(name="load_weights", scope=Scope.STEP, params=LOAD_WEIGHTS_PARAMS)
    def _op_load_weights(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """One bucket of a weight update (`last` ends it); the batch is {name: tensor}."""
        last = bool(params.get("last", True))
        return {}, self.load_bucket(batch, last=last, version=params.get("version"))

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: Any = None
    ) -> Metrics:
        """In-process hand-off (colocated actor): one complete update from (name, tensor)
        pairs, consumed lazily (one tensor at a time)."""
        return self._updated(self._sink().update(weights), version)

    def load_bucket(self, bucket: Any, *, last: bool, version: Any = None) -> Metrics:
        """One bucket of a streamed update (disaggregated: buckets arrive as messages)."""
        metrics = self._sink().bucket(bucket, last=last)
        return self._updated(metrics, version) if last else metrics

    def _sink(self) -> WeightSink:
        if self.weights is None:
            raise RuntimeError(f"{self.backend_name} rollout used before setup (or after close)")
        return self.weights

    def _updated(self, metrics: Metrics, version: Any) -> Metrics:
        """A complete update landed: the policy version it carries."""
        if version is not None:
            self.policy_version = int(version)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "policy_version": self.policy_version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = int(state.get("calls", 0))
        self.policy_version = state.get("policy_version")

    def _call_options(self, params: Params) -> Any:
        """The options of one generate call: the backend's, with sampling overrides."""
        assert self.opts is not None
        if self.opts.env and not self.runs_environments:
            raise BatchError(
                f"{self.backend_name} rollout: env {self.opts.env!r} is set, but this backend "
                "does not run environments yet; use backend: hf for multi-turn rollouts"
            )
        given = {k: params[k] for k in SAMPLING_OVERRIDES if params.get(k) is not None}
        merged = replace(self.opts, **given)
        try:
            merged.validate("params")
        except ConfigError as exc:
            raise BatchError(f"{self.backend_name} rollout: bad generate params: {exc}") from exc
        return merged

    def _call_seed(self, params: Params) -> int:
        """The seed of one generate call: `params["seed"]`, else one mixed from (seed,
        step, mb_id) when the runtime passes them (it does), else from (seed, call count).
        So a micro-batch's samples do not depend on which replica ran it or what ran
        before it; the replica index is deliberately not part of it."""
        if params.get("seed") is not None:
            seed = int(params["seed"])
        elif "step" in params and "mb_id" in params:
            seed = mix_seed(self.seed, params["step"], params["mb_id"])
        else:
            seed = mix_seed(self.seed, "call", self.calls)
        self.calls += 1
        return seed

    def _generate_metrics(self, gen_s: float, tokens: int, rows: int) -> Metrics:
        metrics = {
            "rollout/gen_s": gen_s,
            "rollout/tokens": float(tokens),
            "rollout/tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
            "rollout/response_len_mean": tokens / rows,
        }
        if self.policy_version is not None:
            metrics["rollout/policy_version"] = float(self.policy_version)
        return metrics


# What every rollout backend's `generate` declares (the contract all three speak); its
# inputs are the table's (config/fields.py), its outputs add what a rollout passes on.
GENERATE_OUTPUTS = (
    "prompt_ids",
    "prompt_mask",
    "response_ids",
    "response_mask",
    "rollout_logprobs",
    "group_index",
    # multi-turn only (a backend running an `env`, see multiturn.py):
    "env_reward",  # [B] float32, the sum of the environment's step rewards
    "num_turns",  # [B] int64, model turns of each trajectory
)
MULTI_TURN_OUTPUTS = ("env_reward", "num_turns")
# The dataflow `params:` each rollout op reads (a per-call override of the sampling
# options, a fixed seed; a weight bucket's `last`/`version`); other keys are typos.
GENERATE_PARAMS = (*SAMPLING_OVERRIDES, "seed")


def check_prompts(
    ids: torch.Tensor,  # [B, P] int, left-padded
    mask: torch.Tensor,  # [B, P] 0/1
    where: str,
    vocab_size: int,
) -> torch.Tensor:
    """Validate a generate call's prompts (every backend's rules) -> the mask as int64.
    Raises BatchError naming `where` and the problem."""
    m = check_ids_mask(ids, mask, "prompt_ids", "prompt_mask", where, "[B, P]")
    check_left_padded(m, where)
    empty = m.sum(-1) == 0  # [B]
    if bool(empty.any()):
        rows = torch.nonzero(empty).flatten().tolist()
        raise BatchError(f"{where}: rows {rows[:8]} have an empty prompt")
    valid = ids[m.bool()].to(torch.int64)
    outside = (valid < 0) | (valid >= vocab_size)
    if bool(outside.any()):
        raise BatchError(
            f"{where}: prompt token ids {valid[outside][:8].tolist()} outside the vocabulary "
            f"[0, {vocab_size})"
        )
    return m


def eos_ids(configured: int | None, *sources: Any) -> list[int]:
    """Stop ids: the configured one, else every id named by `sources` (the tokenizer's
    eos_token_id, the generation config's: an int, a list, or None), in order, once."""
    if configured is not None:
        return [configured]
    ids: list[int] = []
    for source in sources:
        items: Iterable[Any] = [source] if isinstance(source, int) else list(source or [])
        for i in items:
            if int(i) not in ids:
                ids.append(int(i))
    return ids

"""Reward role backends that call an external service: `http` (JSON) and `zmq` (MessagePack).

Consumes one micro-batch per `score` task, in the layout every role sees
(stages/common.py), like the in-process `function` reward backend:

    prompt_ids     # [B, P] int   left-padded
    prompt_mask    # [B, P] 0/1   optional; 1 = real token (else prompt_lengths [B], else all)
    response_ids   # [B, R] int   right-padded
    response_mask  # [B, R] 0/1   optional (else response_lengths [B], else all R tokens)
    metadata_json  # [B, L] uint8 optional: the dataset record's other fields (e.g. `answer`)
    any other [B]-shaped tensor   -> added to each sample's metadata under its name

and produces `rewards  # [B] float32`, plus metrics `reward/service_failures` (samples
that got the fallback score), `reward/service_retries`, `reward/service_requests`,
`reward/service_latency_ms` (mean over answered requests), and `reward/info/<key>` (mean
of each numeric `info` value the service returned).

Text: with `options.tokenizer` ("builtin" or a local tokenizer directory, as for the
`function` backend) the prompt and response are decoded (special tokens skipped) and
sent beside the ids; without one, `prompt` and `response` are empty strings and the
service works on ids.

Sample ids are `"<step>-<mb_id>-<row>"`: unique within a run, stable across retries.

Threading: `Role.handle` runs in a worker thread of the stage process. The role owns a
private asyncio loop running in its own thread ("reward-<protocol>-loop"), created in
`setup` and stopped and closed in `close`; `handle` submits the client's coroutine to it
and blocks on the result. HTTP connections and the ZMQ socket live on that loop between
micro-batches, and `handle`/`close` work from any thread, even one that runs an event
loop of its own. The client's timeouts and retries bound every wait.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from hybridflow.config.loader import from_dict
from hybridflow.data.batching import row_metadata
from hybridflow.errors import BatchError
from hybridflow.reward.client import ClientConfig, RewardClient, ScoreResult, make_client
from hybridflow.reward.schema import Item
from hybridflow.stages.base import Batch, Metrics, Params, StageContext
from hybridflow.stages.common import options_path
from hybridflow.stages.contract import RoleBase, op
from hybridflow.transport import aio

_NOT_METADATA = (
    "prompt_ids",
    "prompt_mask",
    "prompt_lengths",
    "response_ids",
    "response_mask",
    "response_lengths",
    "metadata_json",
)


@dataclass(frozen=True, kw_only=True)
class HttpOptions(ClientConfig):
    url: str  # http://host:port/score
    tokenizer: str | None = None


@dataclass(frozen=True, kw_only=True)
class ZmqOptions(ClientConfig):
    endpoint: str  # tcp://host:port
    tokenizer: str | None = None


class _ServiceReward(RoleBase):
    """Shared body of HttpReward / ZmqReward; subclasses pick protocol and options."""

    protocol: ClassVar[Literal["http", "zmq"]]
    options_cls: ClassVar[type]

    def __init__(self) -> None:
        self._loop: _LoopThread | None = None
        self._client: RewardClient | None = None
        self._tokenizer = None

    def setup(self, ctx: StageContext) -> None:
        path = options_path(ctx)
        opts = from_dict(self.options_cls, ctx.options, path)
        address = opts.url if self.protocol == "http" else opts.endpoint
        if opts.tokenizer:
            from hybridflow.models.loader import load_tokenizer  # only when text is wanted

            self._tokenizer = load_tokenizer(opts.tokenizer, None, f"{path}.tokenizer")
        self._client = make_client(self.protocol, address, opts, path=path)
        self._loop = _LoopThread(f"reward-{self.protocol}-loop")
        ctx.log.info("reward service %s (%s)", address, self.protocol)

    @op(inputs=("prompt_ids", "response_ids"), outputs=("rewards",))
    def score(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """One reward per row from the external service (retried, then reported)."""
        assert self._loop is not None and self._client is not None
        step, mb_id = int(params.get("step", 0)), int(params.get("mb_id", 0))
        items = batch_to_items(batch, step=step, mb_id=mb_id, tokenizer=self._tokenizer)
        result = self._loop.run(self._client.score(items, step=step, mb_id=mb_id))
        rewards = torch.tensor(result.rewards, dtype=torch.float32)  # [B]
        return {"rewards": rewards}, _metrics(result)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def close(self) -> None:
        if self._loop is None:
            return
        try:
            if self._client is not None:
                self._loop.run(self._client.aclose())
        finally:
            self._loop.close()
            self._loop, self._client = None, None


class _LoopThread:
    """An asyncio loop in a daemon thread; `run(coro)` blocks the caller until it is done."""

    def __init__(self, name: str) -> None:
        self.loop = aio.loop_factory()()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        """Cancel what is left (a `handle` whose caller gave up), stop, join, close."""

        async def cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
            await self.loop.shutdown_asyncgens()

        try:
            self.run(cancel_rest())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()


class HttpReward(_ServiceReward):
    """`backend: http`: POST JSON batches to `options.url`."""

    protocol = "http"
    options_cls = HttpOptions


class ZmqReward(_ServiceReward):
    """`backend: zmq`: MessagePack batches over a DEALER socket to `options.endpoint`."""

    protocol = "zmq"
    options_cls = ZmqOptions


def _metrics(result: ScoreResult) -> Metrics:
    lat = result.latencies_ms
    out: Metrics = {
        "reward/service_failures": float(result.failures),
        "reward/service_retries": float(result.retries),
        "reward/service_requests": float(result.requests),
        "reward/service_latency_ms": sum(lat) / len(lat) if lat else 0.0,
    }
    sums: dict[str, list[float]] = {}
    for info in result.info.values():
        for key, value in info.items():
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if numeric and math.isfinite(value):
                sums.setdefault(key, []).append(float(value))
    for key, values in sums.items():
        out[f"reward/info/{key}"] = sum(values) / len(values)
    return out


def _rows(ids: torch.Tensor, mask: torch.Tensor | None, lengths: torch.Tensor | None, name: str):
    """Per row, the real tokens of `ids  # [B, T]` as a list of ints."""
    if ids.dim() != 2:
        raise BatchError(f"{name} must be [B, T], got shape {tuple(ids.shape)}")
    b, t = ids.shape
    if mask is not None:
        if mask.shape != ids.shape:
            raise BatchError(f"{name} mask shape {tuple(mask.shape)} != ids {tuple(ids.shape)}")
        m = mask.bool()
        return [ids[i][m[i]].tolist() for i in range(b)]
    if lengths is not None:
        if lengths.shape != (b,) or bool((lengths < 0).any()) or bool((lengths > t).any()):
            raise BatchError(f"{name} lengths must be [B] in [0, {t}], got {lengths.tolist()}")
        return [ids[i, : int(lengths[i])].tolist() for i in range(b)]
    return ids.tolist()


def batch_to_items(batch: Batch, *, step: int, mb_id: int, tokenizer=None) -> list[Item]:
    """One wire `Item` per row of the micro-batch (see the module docstring for fields)."""
    for key in ("prompt_ids", "response_ids"):
        if key not in batch:
            raise BatchError(f"reward service backend needs {key!r}; the batch has {sorted(batch)}")
    prompts = _rows(
        batch["prompt_ids"], batch.get("prompt_mask"), batch.get("prompt_lengths"), "prompt_ids"
    )
    responses = _rows(
        batch["response_ids"],
        batch.get("response_mask"),
        batch.get("response_lengths"),
        "response_ids",
    )
    b = len(prompts)
    if len(responses) != b:
        raise BatchError(f"prompt_ids has {b} rows, response_ids {len(responses)}")
    metadata = _metadata(batch, b)
    if tokenizer is not None:
        texts_p = tokenizer.batch_decode(prompts, skip_special_tokens=True)
        texts_r = tokenizer.batch_decode(responses, skip_special_tokens=True)
    else:
        texts_p = texts_r = [""] * b
    return [
        Item(
            id=f"{step}-{mb_id}-{i}",
            prompt=texts_p[i],
            response=texts_r[i],
            prompt_ids=prompts[i],
            response_ids=responses[i],
            metadata=metadata[i],
        )
        for i in range(b)
    ]


def _metadata(batch: Batch, b: int) -> list[dict[str, Any]]:
    """Per row: the decoded `metadata_json` record plus every other [B]-shaped tensor."""
    try:
        return row_metadata(batch, b, exclude=_NOT_METADATA)
    except ValueError as exc:
        raise BatchError(f"reward service backend: {exc}") from exc

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

Concurrency: `score` is a concurrent op (stages/contract.py): the stage host awaits it
on the stage process's event loop, several micro-batches at once, each awaiting the
service without blocking the loop; no thread or loop of its own exists. The client's
`max_concurrency` bounds the requests of all of them together, and its timeouts and
retries bound every wait. The client opens its session/socket on its first request,
so it belongs to the loop of the first `score` (aiohttp sessions and ZMQ sockets cannot
move between loops): scoring on another loop is an error, and `aclose()`, awaited by
the host on that loop before `close()`, releases it (`close()` releases a client that
`aclose` missed, on its loop while that loop lives). A failing `score` raises only once
the scores that arrived before it have finished, so failures reach the coordinator in
micro-batch order (with a dead service the error names the first micro-batch, not
whichever timed out first). Turning ids into `Item`s (decoding text with the
tokenizer) runs in `asyncio.to_thread`: for micro-batches of thousands of tokens per
row it takes 0.1-1 s of CPU, which would stall heartbeats and the other micro-batches'
I/O on the loop. `handle` (scripts, tests) runs one `score` on a private loop and
releases the client before that loop ends.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from hybridflow.config.fields import METADATA, SEQUENCE_FIELDS
from hybridflow.config.loader import from_dict
from hybridflow.data.batching import row_metadata
from hybridflow.errors import BatchError
from hybridflow.reward.client import ClientConfig, RewardClient, ScoreResult, make_client
from hybridflow.reward.schema import Item
from hybridflow.stages.base import Batch, Metrics, Params, StageContext
from hybridflow.stages.common import options_path
from hybridflow.stages.contract import RoleBase, op
from hybridflow.transport import aio

# Batch fields that are not a sample's metadata: the sequences, the record they came
# from, and two length names no built-in op produces (kept out if a batch has them).
_NOT_METADATA = (*SEQUENCE_FIELDS, METADATA, "prompt_lengths", "response_lengths")

log = logging.getLogger("hybridflow.stages.reward")


@dataclass(frozen=True, kw_only=True)
class HttpOptions(ClientConfig):
    url: str  # http://host:port/score
    tokenizer: str | None = None  # "builtin" or a directory: also send decoded text


@dataclass(frozen=True, kw_only=True)
class ZmqOptions(ClientConfig):
    endpoint: str  # tcp://host:port
    tokenizer: str | None = None  # "builtin" or a directory: also send decoded text


class _ServiceReward(RoleBase):
    """Shared body of HttpReward / ZmqReward; subclasses pick protocol and options."""

    protocol: ClassVar[Literal["http", "zmq"]]
    options_cls: ClassVar[type]

    def __init__(self) -> None:
        self._make_client: Callable[[], RewardClient] | None = None
        self._client: RewardClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None  # None: not used yet
        self._tokenizer = None
        self._closing: asyncio.Task[None] | None = None  # see close()
        self._arrived = 0  # score calls so far: the arrival number of the next one
        self._in_flight: dict[int, asyncio.Future[None]] = {}  # arrival number -> done

    def setup(self, ctx: StageContext) -> None:
        path = options_path(ctx)
        opts = from_dict(self.options_cls, ctx.options, path)
        address = opts.url if self.protocol == "http" else opts.endpoint
        if opts.tokenizer:
            from hybridflow.models.loader import load_tokenizer  # only when text is wanted

            self._tokenizer = load_tokenizer(opts.tokenizer, None, f"{path}.tokenizer")
        self._make_client = functools.partial(make_client, self.protocol, address, opts, path=path)
        # Made here so that a bad address or an unset token_env fails setup. It holds no
        # loop-bound state yet: the session/socket and the semaphore are made on its
        # first request, inside the loop of the first `score`.
        self._client = self._make_client()
        ctx.log.info("reward service %s (%s)", address, self.protocol)

    @op(inputs=("prompt_ids", "response_ids"), outputs=("rewards",), concurrent=True)
    async def score(self, batch: Batch, params: Params) -> tuple[Batch, Metrics]:
        """One reward per row from the external service (retried, then reported)."""
        step, mb_id = int(params.get("step", 0)), int(params.get("mb_id", 0))
        client = self._bound_client()
        seq, done = self._arrived, asyncio.get_running_loop().create_future()
        self._arrived += 1
        self._in_flight[seq] = done
        try:
            # Off the loop: decoding a micro-batch of long responses costs 0.1-1 s of CPU.
            items = await asyncio.to_thread(
                batch_to_items, batch, step=step, mb_id=mb_id, tokenizer=self._tokenizer
            )
            result = await client.score(items, step=step, mb_id=mb_id)
        except Exception:
            # Fail in arrival order: wait for the scores that came before this one, so
            # that when a dead service fails every micro-batch the error names the first,
            # not whichever timed out first.
            earlier = [f for s, f in self._in_flight.items() if s < seq]
            if earlier:
                await asyncio.wait(earlier)
            raise
        finally:
            del self._in_flight[seq]
            done.set_result(None)
        rewards = torch.tensor(result.rewards, dtype=torch.float32)  # [B]
        return {"rewards": rewards}, _metrics(result)

    def _bound_client(self) -> RewardClient:
        """The client, bound to the running loop on first use (a new one after aclose)."""
        loop = asyncio.get_running_loop()
        if self._client_loop is None:
            if self._client is None:
                assert self._make_client is not None  # set by setup, which guards every op
                self._client = self._make_client()
            self._client_loop = loop
        elif self._client_loop is not loop:
            raise RuntimeError(
                f"{type(self).__name__}: the {self.protocol} client belongs to another event "
                "loop; run every call of a role on one loop and `await role.aclose()` on it "
                "(`handle` does this for one call)"
            )
        assert self._client is not None
        return self._client

    def handle(self, op_name: str, batch: Any, params: Any) -> Any:
        """`RoleBase.handle`, except that the client opened on the private loop is
        released before that loop ends (nothing outlives it, the next call opens anew)."""
        spec = self.op_spec(op_name)
        fn = self.bound_op(spec)
        if not spec.concurrent:
            return fn(batch, params)

        async def once() -> Any:
            try:
                return await fn(batch, params)
            finally:
                if self._client_loop is asyncio.get_running_loop():  # opened here
                    await self.aclose()

        return aio.run(once())

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    async def aclose(self) -> None:
        """Release the client's session/socket, on the loop that opened it (the host
        awaits this on the stage's loop before `close`)."""
        client, loop = self._client, self._client_loop
        if client is None or loop is None:
            return  # not used since setup / the last aclose: it holds nothing
        if loop is not asyncio.get_running_loop():
            raise RuntimeError(
                f"{type(self).__name__}.aclose: await it on the loop that ran `score`"
            )
        self._client = self._client_loop = None
        await client.aclose()

    def close(self) -> None:
        """Normally nothing is left: `aclose` released the client, or no `score` ever ran
        (setup failed, or nothing was scored), so nothing was opened. If a caller scored
        on its own loop and never awaited `aclose`, release the client on that loop."""
        client, loop = self._client, self._client_loop
        self._client = self._client_loop = self._make_client = None
        self._tokenizer = None
        if client is None or loop is None:
            return
        if loop.is_closed():  # its transports died with it; no other loop can close them
            log.warning(
                "%s: the loop that used the %s client closed before `aclose`; its "
                "connections were left to the garbage collector",
                type(self).__name__,
                self.protocol,
            )
        elif not loop.is_running():
            loop.run_until_complete(client.aclose())
        elif _running_loop() is not loop:  # its loop runs in another thread
            asyncio.run_coroutine_threadsafe(client.aclose(), loop).result()
        else:  # called from a coroutine on that loop, which cannot block on it
            self._closing = loop.create_task(client.aclose(), name="reward-client-close")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


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

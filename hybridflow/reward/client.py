"""The reward-service client: batching, bounded concurrency, timeouts, retries, failure policy.

Consumes a list of `schema.Item`s for one micro-batch and produces one float per item,
in order. Used by the `http` and `zmq` reward role backends (stages/reward/service.py)
and by anything else that wants to call a reward service from asyncio.

    items ──split by max_batch──> requests (request_id = <nonce>.<call>-<step>-<mb>-<k>)
      each request: acquire semaphore (max_concurrency) -> transport.post -> release
        200           -> decode_reply (protocol errors raise, never retried)
        408/429/5xx,
        timeout,
        connection    -> sleep backoff_s * 2**(attempt-1), equal jitter, capped by
                         backoff_max_s (or the server's Retry-After), then retry the SAME
                         request_id; after `retries` retries apply the failure policy
        other 4xx     -> RewardServiceError at once (a bad request or bad credentials
                         will not get better by asking again)
        3xx           -> RewardServiceError at once naming the target: redirects are
                         followed only with `follow_redirects: true` (HTTP)
      failure policy: "fail"      -> RewardServiceError(service, last status, sample ids)
                      fallback: x -> those samples get x, counted in `failures`, warning

Invariants:
  - the semaphore bounds requests in flight from this client; backoff sleeps happen
    outside it, so waiting retries do not hold slots;
  - each sample id is accepted once: one validated reply per request, ids checked
    against the request, so a retried batch can never be double-counted;
  - a protocol violation (and a non-retryable 4xx) is an error under every policy:
    the fallback score is for outages, not for a service that is wrong.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from hybridflow.errors import ConfigError, RewardProtocolError, RewardServiceError
from hybridflow.reward.schema import (
    DEFAULT_MAX_BODY_BYTES,
    PROTOCOL_VERSION,
    Health,
    Item,
    Reward,
    ScoreRequest,
    decode_as,
    decode_reply,
    encode,
    error_text,
)
from hybridflow.reward.transports import Answer, MalformedAnswer, Transport, TransportFailure

log = logging.getLogger("hybridflow.reward.client")

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class FallbackPolicy:
    """`on_failure: {fallback: 0.0}`: unreachable-service samples get this score."""

    fallback: float

    def validate(self, path: str) -> None:
        if not math.isfinite(self.fallback):
            raise ConfigError(f"{path}.fallback", f"must be a finite number, got {self.fallback}")


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """What every service client takes, whatever the protocol (role `options:` keys)."""

    max_batch: int = 64  # items per request
    max_concurrency: int = 4  # requests in flight from one client
    timeout_s: float = 30.0  # per attempt
    retries: int = 3  # attempts = retries + 1
    backoff_s: float = 0.5  # first retry waits ~backoff_s, doubling each time
    backoff_max_s: float = 10.0  # cap of one backoff wait
    token_env: str | None = None  # name of an env var holding a bearer token (HTTP)
    # After the last retry: "fail" stops the run; {fallback: x} scores those samples x
    on_failure: Literal["fail"] | FallbackPolicy = "fail"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger replies are protocol errors
    follow_redirects: bool = False  # HTTP: a 3xx is an error unless this is true

    def validate(self, path: str) -> None:
        def need(ok: bool, key: str, what: str, value: object) -> None:
            if not ok:
                raise ConfigError(f"{path}.{key}" if path else key, f"{what}, got {value!r}")

        need(self.max_batch >= 1, "max_batch", "must be >= 1", self.max_batch)
        need(self.max_concurrency >= 1, "max_concurrency", "must be >= 1", self.max_concurrency)
        need(self.timeout_s > 0, "timeout_s", "must be > 0", self.timeout_s)
        need(self.retries >= 0, "retries", "must be >= 0", self.retries)
        need(self.backoff_s >= 0, "backoff_s", "must be >= 0", self.backoff_s)
        need(self.backoff_max_s >= 0, "backoff_max_s", "must be >= 0", self.backoff_max_s)
        need(self.max_body_bytes >= 1024, "max_body_bytes", "must be >= 1024", self.max_body_bytes)

    def token(self, path: str = "") -> str | None:
        """The bearer token from `token_env`; a named but unset variable is a config error."""
        if not self.token_env:
            return None
        value = os.environ.get(self.token_env, "")
        if not value:
            key = f"{path}.token_env" if path else "token_env"
            raise ConfigError(key, f"environment variable {self.token_env!r} is not set or empty")
        return value


@dataclass
class ScoreResult:
    rewards: list[float]  # one per item, in item order
    failures: int = 0  # samples that got the fallback score
    retries: int = 0  # retry attempts made (all requests)
    requests: int = 0  # attempts made (all requests)
    latencies_ms: list[float] = field(default_factory=list)  # of answered attempts
    info: dict[str, dict] = field(default_factory=dict)  # sample id -> service's `info`


class RewardClient:
    """Scores items against one service. Create and use it inside one event loop."""

    def __init__(
        self,
        transport: Transport,
        config: ClientConfig,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.transport = transport
        self.config = config
        self._rng = rng or random.Random()
        self._nonce = uuid.uuid4().hex[:12]  # makes request ids unique across clients/runs
        self._calls = 0  # ... and across score() calls of this client (same step/mb twice)
        self._sem: asyncio.Semaphore | None = None

    @property
    def service(self) -> str:
        return self.transport.address

    async def score(self, items: list[Item], *, step: int = 0, mb_id: int = 0) -> ScoreResult:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.config.max_concurrency)
        n = self.config.max_batch
        self._calls += 1
        requests = [
            ScoreRequest(
                version=PROTOCOL_VERSION,
                request_id=f"{self._nonce}.{self._calls}-{step}-{mb_id}-{k}",
                step=step,
                mb_id=mb_id,
                items=items[i : i + n],
            )
            for k, i in enumerate(range(0, len(items), n))
        ]
        result = ScoreResult(rewards=[])
        tasks = [
            asyncio.create_task(self._request(req, result), name=f"reward {req.request_id}")
            for req in requests
        ]
        try:
            replies = await asyncio.gather(*tasks)
        finally:  # first error: stop the other requests, and never leave a task behind
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for req, reply in zip(requests, replies, strict=True):
            if reply is None:  # failed under the fallback policy
                assert isinstance(self.config.on_failure, FallbackPolicy)
                result.rewards.extend([self.config.on_failure.fallback] * len(req.items))
                result.failures += len(req.items)
                continue
            for item in req.items:
                r = reply[item.id]
                result.rewards.append(r.reward)
                if r.info:
                    result.info[item.id] = r.info
        return result

    async def _request(self, req: ScoreRequest, result: ScoreResult) -> dict[str, Reward] | None:
        """One request until it succeeds or its retries run out (-> None under fallback)."""
        cfg = self.config
        body = encode(req, self.transport.encoding)
        assert self._sem is not None
        last, last_status, retry_after = "", "", None
        for attempt in range(cfg.retries + 1):
            if attempt:
                result.retries += 1
                await asyncio.sleep(self._backoff(attempt, retry_after))
            retry_after = None
            async with self._sem:
                result.requests += 1
                t0 = time.perf_counter()
                try:
                    answer = await self.transport.post(req.request_id, body, cfg.timeout_s)
                except TransportFailure as exc:
                    last, last_status = str(exc), "unreachable"
                    log.info("reward service %s, %s: %s", self.service, req.request_id, last)
                    continue
                except MalformedAnswer as exc:
                    raise self._error(req, "protocol", str(exc), RewardProtocolError) from exc
                result.latencies_ms.append((time.perf_counter() - t0) * 1e3)
            if answer.status == 200:
                return decode_reply(
                    answer.body,
                    self.transport.encoding,
                    req,
                    service=self.service,
                    max_body_bytes=cfg.max_body_bytes,
                )
            last, last_status = f"status {answer.status}: {self._why(answer)}", str(answer.status)
            if 300 <= answer.status < 400:
                last = (
                    f"answered status {answer.status}, a redirect to {answer.location!r}, "
                    "which is not followed (set the option follow_redirects: true to follow it)"
                )
                raise self._error(req, str(answer.status), last, RewardServiceError)
            if answer.status not in RETRYABLE_STATUS:
                raise self._error(req, str(answer.status), last, RewardServiceError)
            retry_after = answer.retry_after_s
            log.info("reward service %s, %s: %s", self.service, req.request_id, last)

        ids = [item.id for item in req.items]
        if isinstance(cfg.on_failure, FallbackPolicy):
            log.warning(
                "reward service %s failed %d times (last: %s); %d samples get fallback "
                "reward %s: %s",
                self.service,
                cfg.retries + 1,
                last,
                len(ids),
                cfg.on_failure.fallback,
                _show(ids),
            )
            return None
        raise self._error(
            req, last_status, f"failed after {cfg.retries + 1} attempts; last error {last}"
        )

    def _why(self, answer: Answer) -> str:
        return error_text(answer.body, self.transport.encoding, limit=300)

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        cfg = self.config
        return backoff_delay(attempt, cfg.backoff_s, cfg.backoff_max_s, self._rng, retry_after)

    def _error(self, req: ScoreRequest, status: str, what: str, cls=RewardServiceError):
        ids = tuple(item.id for item in req.items)
        return cls(
            f"reward service {self.service} {what} (request {req.request_id}, "
            f"samples {_show(ids)})",
            service=self.service,
            status=status,
            sample_ids=ids,
        )

    async def health(self) -> dict:
        """GET /health (HTTP) or a health message (ZeroMQ); raises RewardServiceError."""
        try:
            answer = await self.transport.get_health(self.config.timeout_s)
        except (TransportFailure, MalformedAnswer) as exc:
            raise RewardServiceError(
                f"reward service {self.service} health check failed: {exc}", service=self.service
            ) from exc
        if answer.status != 200:
            raise RewardServiceError(
                f"reward service {self.service} health check: status {answer.status}: "
                f"{self._why(answer)}",
                service=self.service,
                status=str(answer.status),
            )
        try:
            return msgspec.structs.asdict(decode_as(answer.body, Health, self.transport.encoding))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RewardProtocolError(
                f"reward service {self.service} health reply is malformed: {exc}",
                service=self.service,
                status="protocol",
            ) from exc

    async def aclose(self) -> None:
        await self.transport.aclose()


def backoff_delay(
    attempt: int,
    backoff_s: float,
    backoff_max_s: float,
    rng: random.Random,
    retry_after: float | None = None,
) -> float:
    """Seconds to wait before retry `attempt` (1, 2, ...): exponential backoff with equal
    jitter, half fixed, half random (spreads the retries of many clients without ever
    retrying immediately), capped by `backoff_max_s`; a server's Retry-After wins (capped
    too). Shared by every service client (reward, environment)."""
    if retry_after is not None:
        return min(retry_after, backoff_max_s)
    d = min(backoff_max_s, backoff_s * 2 ** (attempt - 1))
    return d / 2 + rng.uniform(0, d / 2)


def _show(ids, k: int = 8) -> str:
    ids = list(ids)
    return ", ".join(ids[:k]) + (f", ... ({len(ids)} in all)" if len(ids) > k else "")


def make_client(
    protocol: Literal["http", "zmq"],
    address: str,
    config: ClientConfig,
    *,
    path: str = "",
    rng: random.Random | None = None,
) -> RewardClient:
    """A client for `address` (an http(s) URL, or a tcp:// / ipc:// endpoint for zmq).
    `path` is the config key of these options, for error messages."""
    from hybridflow.reward.transports import HttpTransport, ZmqTransport

    key = f"{path}." if path else ""
    if protocol == "http":
        if not address.startswith(("http://", "https://")):
            raise ConfigError(f"{key}url", f"expected http://host:port/path, got {address!r}")
        transport: Transport = HttpTransport(
            address,
            max_connections=config.max_concurrency,
            max_body_bytes=config.max_body_bytes,
            token=config.token(path),
            follow_redirects=config.follow_redirects,
        )
    else:
        if config.token_env:
            raise ConfigError(
                f"{key}token_env", "applies to http services only; zmq services bind to loopback"
            )
        if config.follow_redirects:
            raise ConfigError(f"{key}follow_redirects", "applies to http services only")
        if not address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"{key}endpoint", f"expected tcp://host:port, got {address!r}")
        transport = ZmqTransport(address, max_body_bytes=config.max_body_bytes)
    return RewardClient(transport, config, rng=rng)

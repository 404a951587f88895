"""The `http` / `zmq` reward role backends through the Role seam: options from config,
micro-batch tensors in, `rewards  # [B]` and metrics out, against a real SDK server.

`score` is a concurrent op: like the stage runtime, these tests await it on one event
loop (the test's), several at once where it matters, and `await role.aclose()` on that
loop before `close()`. `handle` (a private loop per call) is covered on its own."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.data.batching import encode_metadata
from hybridflow.errors import BatchError, ConfigError, RewardServiceError
from hybridflow.reward import start_server
from hybridflow.stages import create_role
from hybridflow.stages.base import Role, StageContext
from hybridflow.transport import aio

FAST = {"timeout_s": 1.0, "retries": 1, "backoff_s": 0.01}


def ctx(tmp_path: Path, options: dict) -> StageContext:
    return StageContext(
        stage="judge",
        replica=0,
        device=torch.device("cpu"),
        seed=0,
        run_dir=tmp_path,
        options=options,
        log=logging.getLogger("test.reward"),
    )


async def score(role: Any, batch: dict[str, torch.Tensor], params: dict) -> Any:
    """What the stage host does for a concurrent op: await it on the running loop."""
    return await role.bound_op(role.op_spec("score"))(batch, params)


@contextlib.asynccontextmanager
async def reward_role(backend: str, tmp_path: Path, options: dict) -> AsyncIterator[Any]:
    """A set-up role whose calls share this loop; released as the host does at shutdown."""
    role = create_role("reward", backend)
    role.setup(ctx(tmp_path, options))
    try:
        yield role
    finally:
        await role.aclose()
        role.close()


def micro_batch() -> dict[str, torch.Tensor]:
    return {
        "prompt_ids": torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9], [4, 4, 4, 4]]),  # [B=3, P=4]
        "prompt_mask": torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]]),
        "response_ids": torch.tensor([[1, 2, 3], [4, 0, 0], [0, 0, 0]]),  # [B, R=3]
        "response_lengths": torch.tensor([3, 1, 0]),  # [B]
        "answer": torch.tensor([7, 8, 9]),  # [B] -> metadata["answer"]
        "weight": torch.tensor([0.5, 1.0, 2.0]),  # [B] -> metadata["weight"]
        "metadata_json": encode_metadata(
            [{"tests": [[1, 2], [3, 5]]}, {}, {"task": "t"}]
        ),  # [B, L]
    }


@pytest.mark.parametrize("protocol", ["http", "zmq"])
async def test_role_scores_a_micro_batch(protocol, tmp_path):
    calls = []

    def fn(prompts, responses, prompt_ids, response_ids, metadata):
        calls.append((prompts, prompt_ids, response_ids, metadata))
        return [
            m["answer"] * m["weight"] + len(r) for r, m in zip(response_ids, metadata, strict=True)
        ]

    async with await start_server(fn, protocol, port=0) as srv:
        key = "url" if protocol == "http" else "endpoint"
        role = create_role("reward", protocol)
        assert isinstance(role, Role)
        role.setup(ctx(tmp_path, {key: srv.address, "max_batch": 2, **FAST}))
        try:
            out, metrics = await score(
                role, micro_batch(), {"step": 4, "mb_id": 2, "policy_version": 4}
            )
            again, _ = await score(role, micro_batch(), {"step": 5, "mb_id": 0})
        finally:
            await role.aclose()
            role.close()
    rewards = out["rewards"]
    assert rewards.dtype == torch.float32 and rewards.shape == (3,)
    assert rewards.tolist() == [3.5 + 3, 8.0 + 1, 18.0 + 0]
    assert torch.equal(again["rewards"], rewards)
    assert metrics["reward/service_requests"] == 2.0  # B=3 in batches of 2
    assert metrics["reward/service_failures"] == 0.0 and metrics["reward/service_retries"] == 0.0
    assert metrics["reward/service_latency_ms"] > 0
    # padding never reaches the service; no tokenizer -> empty text; [B] tensors -> metadata
    first = sorted(calls[:2], key=lambda c: -len(c[0]))  # the 2 requests of the 1st score
    assert [c[1] for c in first] == [[[5, 6], [7, 8, 9]], [[4, 4, 4, 4]]]
    assert [c[2] for c in first] == [[[1, 2, 3], [4]], [[]]]
    assert [c[0] for c in first] == [["", ""], [""]]
    assert first[1][3] == [{"task": "t", "answer": 9, "weight": 2.0}]
    assert first[0][3][0] == {"tests": [[1, 2], [3, 5]], "answer": 7, "weight": 0.5}


async def test_role_trims_padding_and_decodes_with_a_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "a": 1, "b": 2, "c": 3, "d": 4, "x": 5, "y": 6, "z": 7, "w": 8, "v": 9}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>").save_pretrained(
        tmp_path / "tok"
    )

    got = []

    def fn(prompts, responses, prompt_ids, response_ids, metadata):
        got.extend(zip(prompts, responses, prompt_ids, response_ids, strict=True))
        return [0.0] * len(prompts)

    async with await start_server(fn, "http", port=0) as srv:
        options = {"url": srv.address, "tokenizer": str(tmp_path / "tok"), **FAST}
        async with reward_role("http", tmp_path, options) as role:
            await score(role, micro_batch(), {"step": 0, "mb_id": 0})
    assert got == [
        ("x y", "a b c", [5, 6], [1, 2, 3]),
        ("z w v", "d", [7, 8, 9], [4]),
        ("d d d d", "", [4, 4, 4, 4], []),
    ]


async def test_role_fallback_and_fail_when_service_is_down(tmp_path, unused_tcp_port, caplog):
    url = f"http://127.0.0.1:{unused_tcp_port}/score"
    options = {"url": url, "on_failure": {"fallback": -2}, **FAST}
    async with reward_role("http", tmp_path, options) as role:
        out, metrics = await score(role, micro_batch(), {"step": 1, "mb_id": 0})
    assert out["rewards"].tolist() == [-2.0, -2.0, -2.0]
    assert metrics["reward/service_failures"] == 3.0 and metrics["reward/service_retries"] == 1.0

    async with reward_role("http", tmp_path, {"url": url, **FAST}) as role:
        with pytest.raises(RewardServiceError, match=r"1-0-0, 1-0-1, 1-0-2"):
            await score(role, micro_batch(), {"step": 1, "mb_id": 0})


@pytest.mark.parametrize(
    ("backend", "options", "needle"),
    [
        ("http", {}, "stages.judge.options.url: is required"),
        (
            "http",
            {"url": "http://x", "retires": 3},
            "stages.judge.options.retires: unknown key; did you mean 'retries'?",
        ),
        ("http", {"url": "ftp://x"}, "stages.judge.options.url: expected http"),
        ("http", {"url": "http://x", "on_failure": "ignore"}, "stages.judge.options.on_failure"),
        (
            "http",
            {"url": "http://x", "timeout_s": 0},
            "stages.judge.options.timeout_s: must be > 0",
        ),
        (
            "http",
            {"url": "http://x", "tokenizer": "/no/such/dir"},
            "options.tokenizer: no tokenizer directory at '/no/such/dir'",
        ),
        ("zmq", {"url": "tcp://x:1"}, "stages.judge.options.url: unknown key"),
        ("zmq", {"endpoint": "http://x"}, "stages.judge.options.endpoint: expected tcp://"),
    ],
)
def test_role_option_errors_name_the_key(backend, options, needle, tmp_path):
    role = create_role("reward", backend)
    with pytest.raises(ConfigError) as info:
        role.setup(ctx(tmp_path, options))
    role.close()
    assert needle in str(info.value)


def test_role_rejects_unknown_op_and_bad_batches(tmp_path):
    role = create_role("reward", "zmq")
    role.setup(ctx(tmp_path, {"endpoint": "tcp://127.0.0.1:9", **FAST}))
    try:
        with pytest.raises(BatchError, match="unknown op 'train'; known: score"):
            role.handle("train", micro_batch(), {})
        with pytest.raises(BatchError, match="needs 'response_ids'"):
            role.handle("score", {"prompt_ids": torch.zeros(2, 3, dtype=torch.long)}, {})
        bad = {**micro_batch(), "response_lengths": torch.tensor([3, 1, 4])}
        with pytest.raises(BatchError, match=r"lengths must be \[B\] in \[0, 3\]"):
            role.handle("score", bad, {})
    finally:
        role.close()


@pytest.mark.parametrize("protocol", ["http", "zmq"])
async def test_two_scores_are_in_flight_at_once(protocol, tmp_path):
    # The service records when each request arrives and when it is answered: scored one
    # after the other, the second request would arrive after the first was answered.
    spans: list[tuple[float, float]] = []

    async def slow(prompts, responses, prompt_ids, response_ids, metadata):
        start = time.monotonic()
        await asyncio.sleep(0.2)
        spans.append((start, time.monotonic()))
        return [float(m["answer"]) for m in metadata]

    async with await start_server(slow, protocol, port=0) as srv:
        key = "url" if protocol == "http" else "endpoint"
        async with reward_role(protocol, tmp_path, {key: srv.address, **FAST}) as role:
            (a, ma), (b, mb) = await asyncio.gather(
                score(role, micro_batch(), {"step": 0, "mb_id": 0}),
                score(role, {**micro_batch(), "answer": torch.tensor([1, 2, 3])}, {"mb_id": 1}),
            )
    assert a["rewards"].tolist() == [7.0, 8.0, 9.0] and b["rewards"].tolist() == [1.0, 2.0, 3.0]
    assert ma["reward/service_requests"] == mb["reward/service_requests"] == 1.0
    assert len(spans) == 2
    first, second = sorted(spans)  # (arrived, answered), by arrival
    assert second[0] < first[1]  # the second arrived while the first was still being scored


@pytest.mark.parametrize("protocol", ["http", "zmq"])
async def test_handle_releases_its_client_before_its_private_loop_ends(protocol, tmp_path):
    def fn(prompts, responses, prompt_ids, response_ids, metadata):
        return [float(len(r)) for r in response_ids]

    async with await start_server(fn, protocol, port=0) as srv:
        key = "url" if protocol == "http" else "endpoint"
        role = create_role("reward", protocol)
        role.setup(ctx(tmp_path, {key: srv.address, **FAST}))
        try:
            for mb_id in range(2):  # each call on a new private loop, each a fresh client
                out, _ = await asyncio.to_thread(
                    role.handle, "score", micro_batch(), {"mb_id": mb_id}
                )
                assert out["rewards"].tolist() == [3.0, 1.0, 0.0]
            # ... and the role still scores on this loop afterwards
            out, _ = await score(role, micro_batch(), {"mb_id": 2})
            assert out["rewards"].tolist() == [3.0, 1.0, 0.0]
            # a client belongs to one loop: another loop is refused, not silently broken
            with pytest.raises(RuntimeError, match="belongs to another event loop"):
                await asyncio.to_thread(role.handle, "score", micro_batch(), {"mb_id": 3})
        finally:
            await role.aclose()
            role.close()


@pytest.fixture
def aclose_calls(monkeypatch) -> list[asyncio.AbstractEventLoop]:
    """The loop each RewardClient.aclose ran on."""
    from hybridflow.reward.client import RewardClient

    calls: list[asyncio.AbstractEventLoop] = []
    original = RewardClient.aclose

    async def spy(self):
        calls.append(asyncio.get_running_loop())
        await original(self)

    monkeypatch.setattr(RewardClient, "aclose", spy)
    return calls


@pytest.mark.parametrize("protocol", ["http", "zmq"])
def test_close_without_aclose_releases_the_client_on_its_idle_loop(
    protocol, tmp_path, aclose_calls
):
    def fn(prompts, responses, prompt_ids, response_ids, metadata):
        return [0.0] * len(prompts)

    loop = aio.loop_factory()()
    try:
        srv = loop.run_until_complete(start_server(fn, protocol, port=0))
        key = "url" if protocol == "http" else "endpoint"
        role = create_role("reward", protocol)
        role.setup(ctx(tmp_path, {key: srv.address, **FAST}))
        loop.run_until_complete(score(role, micro_batch(), {}))
        role.close()  # no aclose: the loop is idle, so close runs it there
        assert aclose_calls == [loop]
        loop.run_until_complete(srv.aclose())
    finally:
        loop.close()


async def test_close_without_aclose_releases_the_client_on_its_running_loop(tmp_path, aclose_calls):
    def fn(prompts, responses, prompt_ids, response_ids, metadata):
        return [0.0] * len(prompts)

    async with await start_server(fn, "zmq", port=0) as srv:
        role = create_role("reward", "zmq")
        role.setup(ctx(tmp_path, {"endpoint": srv.address, **FAST}))
        await score(role, micro_batch(), {})
        # from a worker thread, as the stage host calls close: it runs aclose on this loop
        await asyncio.to_thread(role.close)
        assert aclose_calls == [asyncio.get_running_loop()]


def test_close_after_failed_setup_or_without_a_score_holds_nothing(tmp_path, aclose_calls):
    role = create_role("reward", "http")
    with pytest.raises(ConfigError):
        role.setup(ctx(tmp_path, {"url": "ftp://x"}))
    role.close()
    role = create_role("reward", "zmq")
    role.setup(ctx(tmp_path, {"endpoint": "tcp://127.0.0.1:9"}))
    aio.run(role.aclose())
    role.close()
    assert aclose_calls == []  # no client ever opened anything to release


async def test_failures_are_raised_in_arrival_order(tmp_path):
    # micro-batch 0 fails slowly, micro-batch 1 at once: 1 still raises after 0
    async def failing(prompts, responses, prompt_ids, response_ids, metadata):
        if metadata[0]["answer"] == 7:  # micro-batch 0
            await asyncio.sleep(0.1)
        raise ValueError("broken")

    raised: list[int] = []

    async def scored(role, batch, mb_id):
        try:
            await score(role, batch, {"mb_id": mb_id})
        except RewardServiceError:
            raised.append(mb_id)
            raise

    async with (
        await start_server(failing, "http", port=0) as srv,
        reward_role("http", tmp_path, {"url": srv.address, **FAST}) as role,
    ):
        errors = await asyncio.gather(
            scored(role, micro_batch(), 0),
            scored(role, {**micro_batch(), "answer": torch.tensor([1, 2, 3])}, 1),
            return_exceptions=True,
        )
    assert [type(e) for e in errors] == [RewardServiceError, RewardServiceError]
    assert "samples 0-0-0" in str(errors[0]) and "samples 0-1-0" in str(errors[1])
    assert raised == [0, 1]

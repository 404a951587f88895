"""The `http` / `zmq` reward role backends through the Role seam: options from config,
micro-batch tensors in, `rewards  # [B]` and metrics out, called from a worker thread
(as the stage runtime does) against a real SDK server."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch

from hybridflow.data.batching import encode_metadata
from hybridflow.errors import BatchError, ConfigError, RewardServiceError
from hybridflow.reward import start_server
from hybridflow.stages import create_role
from hybridflow.stages.base import Role, StageContext

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
            out, metrics = await asyncio.to_thread(
                role.handle, "score", micro_batch(), {"step": 4, "mb_id": 2, "policy_version": 4}
            )
            again, _ = await asyncio.to_thread(
                role.handle, "score", micro_batch(), {"step": 5, "mb_id": 0}
            )
        finally:
            await asyncio.to_thread(role.close)
    rewards = out["rewards"]
    assert rewards.dtype == torch.float32 and rewards.shape == (3,)
    assert rewards.tolist() == [3.5 + 3, 8.0 + 1, 18.0 + 0]
    assert torch.equal(again["rewards"], rewards)
    assert metrics["reward/service_requests"] == 2.0  # B=3 in batches of 2
    assert metrics["reward/service_failures"] == 0.0 and metrics["reward/service_retries"] == 0.0
    assert metrics["reward/service_latency_ms"] > 0
    # padding never reaches the service; no tokenizer -> empty text; [B] tensors -> metadata
    first = sorted(calls[:2], key=lambda c: -len(c[0]))  # the 2 requests of the 1st handle
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
        role = create_role("reward", "http")
        role.setup(ctx(tmp_path, {"url": srv.address, "tokenizer": str(tmp_path / "tok"), **FAST}))
        try:
            await asyncio.to_thread(role.handle, "score", micro_batch(), {"step": 0, "mb_id": 0})
        finally:
            await asyncio.to_thread(role.close)
    assert got == [
        ("x y", "a b c", [5, 6], [1, 2, 3]),
        ("z w v", "d", [7, 8, 9], [4]),
        ("d d d d", "", [4, 4, 4, 4], []),
    ]


async def test_role_fallback_and_fail_when_service_is_down(tmp_path, unused_tcp_port, caplog):
    url = f"http://127.0.0.1:{unused_tcp_port}/score"
    role = create_role("reward", "http")
    role.setup(ctx(tmp_path, {"url": url, "on_failure": {"fallback": -2}, **FAST}))
    try:
        out, metrics = await asyncio.to_thread(
            role.handle, "score", micro_batch(), {"step": 1, "mb_id": 0}
        )
    finally:
        role.close()
    assert out["rewards"].tolist() == [-2.0, -2.0, -2.0]
    assert metrics["reward/service_failures"] == 3.0 and metrics["reward/service_retries"] == 1.0

    role = create_role("reward", "http")
    role.setup(ctx(tmp_path, {"url": url, **FAST}))
    try:
        with pytest.raises(RewardServiceError, match=r"1-0-0, 1-0-1, 1-0-2"):
            await asyncio.to_thread(role.handle, "score", micro_batch(), {"step": 1, "mb_id": 0})
    finally:
        role.close()


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

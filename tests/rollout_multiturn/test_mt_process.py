"""`env_process: true`: the environment in a process of its own, owned by the rollout stage.
The same trajectories as in-process, the child gone after close, and a killed child a
named error at the next call."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from mt_helpers import chat_tokenizer, prompt_batch, tokenizer_dir

from hybridflow.errors import ConfigError, EnvServiceError
from hybridflow.stages.env.builtin.guess_number import make_records
from hybridflow.stages.rollout.hf import HFRollout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stages"))
from stage_helpers import make_role

TOK = chat_tokenizer()


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return tokenizer_dir(tmp_path_factory.mktemp("tok"))


def rollout(tokdir, **kw):
    opts = {
        "model": "tiny",
        "tokenizer": tokdir,
        "max_new_tokens": 5,
        "temperature": 0.0,
        "env": "guess_number",
        "env_options": {"low": 1, "high": 3, "max_turns": 3},
        "max_turns": 3,
        "env_timeout_s": 20.0,
        **kw,
    }
    return make_role(HFRollout, "r", opts)


def test_a_process_environment_gives_the_in_process_trajectories_and_is_gone_after(tokdir):
    batch = prompt_batch(TOK, make_records(3, 0, low=1, high=3, max_turns=3))
    inline, _ = rollout(tokdir).handle("generate", batch, {"step": 0, "mb_id": 0})
    role = rollout(tokdir, env_process=True)
    proc = role.loop.process.proc
    try:
        apart, metrics = role.handle("generate", batch, {"step": 0, "mb_id": 0})
        for key in ("response_ids", "response_mask", "env_reward", "num_turns"):
            assert torch.equal(inline[key], apart[key]), key
        assert int(apart["num_turns"].max()) > 1
        assert metrics["env/service_retries"] == 0
        # a killed child: the next call names the service, no hang
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        with pytest.raises(EnvServiceError, match=role.loop.process.address):
            role.handle("generate", batch, {"step": 1, "mb_id": 0})
    finally:
        role.close()
    assert proc.poll() is not None


def test_a_bad_environment_fails_at_setup_without_a_process(tokdir):
    with pytest.raises(ConfigError, match="env_options"):
        rollout(tokdir, env_process=True, env_options={"no_such_option": 1})
    with pytest.raises(ConfigError, match="env_process"):
        rollout(tokdir, env="remote", env_options={"url": "tcp://127.0.0.1:1"}, env_process=True)

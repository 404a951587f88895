"""The native rollout with an environment: continuous trajectories whose turns continue
their parked K/V. Same tokens as the hf backend's turn-synchronous loop (greedy, same
weights), as re-prefilling every turn, and as running each trajectory alone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from mt_helpers import chat_tokenizer, prompt_batch, tokenizer_dir

from hybridflow.stages.env.builtin.guess_number import make_records
from hybridflow.stages.rollout.hf import HFRollout
from hybridflow.stages.rollout.native.role import NativeRollout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stages"))
from stage_helpers import make_role

TOK = chat_tokenizer()
OUT = ("response_ids", "response_mask", "num_turns", "env_reward")
OVERRIDES = {"initializer_range": 0.3}  # a random model that does not just repeat itself


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return tokenizer_dir(tmp_path_factory.mktemp("tok"))


def options(tokdir, **kw):
    return {
        "model": "tiny",
        "tokenizer": tokdir,
        "model_overrides": OVERRIDES,
        "max_new_tokens": 6,
        "temperature": 0.0,
        "env": "guess_number",
        "env_options": {"low": 1, "high": 3, "max_turns": 4},
        "max_turns": 4,
        **kw,
    }


def native(tokdir, **kw):
    return make_role(
        NativeRollout,
        "r",
        options(tokdir, max_prompt_len=400, kv_cache_gb=0.05, decode_lengths=[256], **kw),
    )


def batch(n):
    return prompt_batch(TOK, make_records(n, 0, low=1, high=3, max_turns=4))


def generate(role, b, mb=0):
    return role.handle("generate", b, {"step": 0, "mb_id": mb})


def test_native_trajectories_equal_hf_and_reuse_their_history(tokdir):
    b = batch(4)
    nat, metrics = generate(native(tokdir), b)
    ref, _ = generate(make_role(HFRollout, "r", options(tokdir)), b)
    assert int(nat["num_turns"].max()) > 1  # the comparison covers continued turns
    for key in OUT:
        assert torch.equal(nat[key], ref[key]), key
    m = nat["response_mask"].bool()
    torch.testing.assert_close(
        nat["rollout_logprobs"][m], ref["rollout_logprobs"][m], atol=1e-4, rtol=1e-4
    )
    # every continued turn prefilled only its new tokens
    assert metrics["rollout/reused_tokens"] > 0
    assert 0 < metrics["rollout/prefill_saved_frac"] < 1
    assert metrics["rollout/turns/mean"] > 1


def test_reuse_off_and_each_trajectory_alone_give_the_same_tokens(tokdir):
    b = batch(3)
    together, _ = generate(native(tokdir), b)
    again, metrics = generate(native(tokdir, reuse_kv=False), b)
    assert metrics["rollout/reused_tokens"] == 0
    for key in OUT:
        assert torch.equal(together[key], again[key]), key
    role = native(tokdir)
    for i in range(3):  # one trajectory per call: its tokens do not depend on the others
        one = {k: v[i : i + 1] for k, v in b.items()}
        alone, _ = generate(role, one)
        width = int(alone["response_mask"].sum())
        assert (
            together["response_ids"][i, :width].tolist()
            == alone["response_ids"][0, :width].tolist()
        )
        assert int(together["num_turns"][i]) == int(alone["num_turns"][0])


def test_sampled_trajectories_repeat_with_the_seed(tokdir):
    role = native(tokdir, temperature=1.0, n=2)
    b = batch(2)
    first, _ = generate(role, b)
    second, _ = generate(role, b)
    other, _ = generate(role, b, mb=1)
    for key in OUT:
        assert torch.equal(first[key], second[key]), key
    assert not torch.equal(first["response_ids"], other["response_ids"])
    assert role.engine is not None
    assert role.engine.call(lambda core: dict(core.sessions)) == {}  # every session freed

"""The native engine core on CPU: exactness against the HF model's own forward,
continuous batching, seeds, stop tokens, and the errors of bad configurations."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from native_helpers import build, engine, prompts, run_all

from hybridflow.errors import BatchError, ConfigError
from hybridflow.stages.rollout.native.forward.model import NativeModel
from hybridflow.stages.rollout.native.request import Request, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@torch.no_grad()
def hf_greedy(model: Any, prompt: torch.Tensor, steps: int) -> list[int]:
    """Reference: the HF model's forward over the whole sequence, argmax, no cache."""
    ids = prompt[None]
    out: list[int] = []
    for _ in range(steps):
        nxt = int(model(input_ids=ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


@torch.no_grad()
def hf_logprobs(model: Any, prompt: torch.Tensor, tokens: torch.Tensor, t: float) -> torch.Tensor:
    """log_softmax(logits / t)[token] of the HF model, recomputed over prompt + response."""
    ids = torch.cat([prompt, tokens])[None]
    logits = model(input_ids=ids).logits[0, prompt.numel() - 1 : -1].float()  # [T, V]
    return torch.log_softmax(logits / t, -1).gather(-1, tokens[:, None]).squeeze(-1)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "module"])
def test_greedy_tokens_equal_the_hf_forward(model: Any, fused: bool) -> None:
    ps = prompts(5, seed=1)
    eng = engine(model, fused_decode=fused)
    assert (eng.model.fused is not None) == fused
    (out,) = run_all(eng, [Request(ps, GREEDY, seed=0)])
    assert out.tokens.shape == (5, 12) and out.lengths.tolist() == [12] * 5
    for i, p in enumerate(ps):
        assert out.tokens[i].tolist() == hf_greedy(model, p, 12)
        # Greedy reports temperature-1 log-probs.
        ref = hf_logprobs(model, p, out.tokens[i], 1.0)
        assert torch.allclose(out.logprobs[i], ref, atol=1e-5)


def test_sampled_logprobs_equal_the_hf_recomputation(model: Any) -> None:
    ps = prompts(3, seed=2)
    params = SamplingParams(temperature=0.7, max_new_tokens=16, n=2)
    (out,) = run_all(engine(model), [Request(ps, params, seed=5)])
    assert out.tokens.shape[0] == 6
    for r in range(6):
        n = int(out.lengths[r])
        ref = hf_logprobs(model, ps[r // 2], out.tokens[r, :n], 0.7)
        assert torch.allclose(out.logprobs[r, :n], ref, atol=1e-5), r  # fp32 tolerance
    assert not torch.equal(out.tokens[0], out.tokens[1])  # n samples of a prompt differ


def test_length_buckets_read_less_and_change_nothing(model: Any) -> None:
    """Decode attention over the smallest length bucket that holds every row's position
    gives the tokens and log-probs of attending to whole slots, reading fewer positions."""
    reqs = [Request(prompts(k, seed=20 + k), GREEDY, seed=0) for k in (3, 2)]
    whole = engine(model, decode_lengths=(64,))
    bucketed = engine(model)
    assert whole.lengths == [64] and bucketed.lengths == [16, 32, 64]
    for a, b in zip(run_all(whole, reqs), run_all(bucketed, reqs), strict=True):
        assert torch.equal(a.tokens, b.tokens)
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-6)
    assert bucketed.stats["attended_positions"] < whole.stats["attended_positions"]
    assert whole.stats["attended_positions"] == 64 * whole.stats["decode_tokens"]


def test_continuous_batching_equals_each_request_alone(qwen: Any) -> None:
    reqs = [Request(prompts(k, seed=10 + k), GREEDY, seed=0) for k in (3, 1, 4, 2)]
    alone = [run_all(engine(qwen), [r])[0].tokens for r in reqs]
    eng = engine(qwen, max_num_seqs=6)  # fewer slots than rows: rows queue for slots
    outs: dict[int, Any] = {}
    ids = [eng.add_request(reqs[0])]
    for step in range(200):
        if step in (2, 5, 9):  # later requests join a running decode batch
            ids.append(eng.add_request(reqs[len(ids)]))
        for o in eng.step():
            outs[o.request_id] = o
        if len(outs) == len(reqs):
            break
    assert sorted(outs) == ids
    for i, rid in enumerate(ids):
        assert torch.equal(outs[rid].tokens, alone[i])
    assert eng.scheduler.active == 0 and eng.in_flight() == 0


def test_a_request_returns_as_soon_as_its_rows_finish(qwen: Any) -> None:
    eng = engine(qwen)
    long = eng.add_request(Request(prompts(2), SamplingParams(max_new_tokens=40), seed=1))
    short = eng.add_request(Request(prompts(2, seed=3), SamplingParams(max_new_tokens=3), seed=1))
    first = []
    while not first:
        first = eng.step()
    assert [o.request_id for o in first] == [short] and eng.in_flight() == 1
    assert long in eng._live


def test_same_seed_same_samples_also_batched_with_others(qwen: Any) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=20, n=3)
    mine = Request(prompts(2, seed=4), params, seed=123)
    (alone,) = run_all(engine(qwen), [mine])
    (again,) = run_all(engine(qwen), [mine])
    assert torch.equal(alone.tokens, again.tokens)
    others = [
        Request(
            prompts(3, seed=5), SamplingParams(temperature=0.9, top_k=5, max_new_tokens=20), seed=9
        ),
        Request(prompts(1, seed=6), SamplingParams(temperature=0.0, max_new_tokens=7), seed=1),
    ]
    batched = run_all(engine(qwen), [others[0], mine, others[1]])[1]
    assert torch.equal(batched.tokens, alone.tokens)
    assert torch.allclose(batched.logprobs, alone.logprobs, atol=1e-5)
    (other_seed,) = run_all(engine(qwen), [Request(mine.prompts, params, seed=124)])
    assert not torch.equal(other_seed.tokens, alone.tokens)


def test_top_k_and_top_p_restrict_the_samples(qwen: Any) -> None:
    ps = prompts(4, seed=7)
    for params in (
        SamplingParams(temperature=1.0, top_k=3, max_new_tokens=10, n=2),
        SamplingParams(temperature=1.0, top_p=0.3, max_new_tokens=10, n=2),
    ):
        (out,) = run_all(engine(qwen), [Request(ps, params, seed=3)])
        for r in range(8):
            full = hf_logprobs(qwen, ps[r // 2], out.tokens[r], 1.0)  # untruncated
            # Truncation renormalises over fewer tokens: sampling log-probs are >= full.
            assert bool((out.logprobs[r] >= full - 1e-5).all())
            if params.top_k == 3:
                with torch.no_grad():
                    ids = torch.cat([ps[r // 2], out.tokens[r]])[None]
                    logits = qwen(input_ids=ids).logits[0, ps[r // 2].numel() - 1 : -1]
                top3 = logits.topk(3, dim=-1).indices
                assert bool((top3 == out.tokens[r][:, None]).any(-1).all())


def test_stop_token_ends_a_row_and_is_part_of_it(qwen: Any) -> None:
    p = prompts(1, seed=8)
    (free,) = run_all(engine(qwen), [Request(p, GREEDY, seed=0)])
    stop = int(free.tokens[0, 4])
    first = free.tokens[0].tolist().index(stop)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,))
    (out,) = run_all(engine(qwen), [Request(p, params, seed=0)])
    assert int(out.lengths[0]) == first + 1 and int(out.tokens[0, first]) == stop
    assert torch.equal(out.tokens[0, : first + 1], free.tokens[0, : first + 1])


def test_one_new_token_and_full_slots(qwen: Any) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    (out,) = run_all(engine(qwen, max_num_seqs=2), [Request(prompts(5), params, seed=0)])
    assert out.tokens.shape == (5, 1)


def test_kv_budget_too_small_names_the_option(qwen: Any) -> None:
    with pytest.raises(ConfigError) as err:
        engine(qwen, kv_cache_gb=1e-6)
    assert err.value.path == "kv_cache_gb"


def test_prompt_longer_than_a_slot_is_refused(qwen: Any) -> None:
    eng = engine(qwen, max_model_len=16)
    with pytest.raises(BatchError, match="max_prompt_len"):
        eng.add_request(Request([torch.arange(2, 12)], SamplingParams(max_new_tokens=8)))


def test_unsupported_architecture_is_a_config_error(tokenizer: Any) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64)
    with pytest.raises(ConfigError) as err:
        NativeModel(GPT2LMHeadModel(cfg), 64, path="stages.rollout.options")
    assert err.value.path == "stages.rollout.options.model" and "gpt2" in str(err.value)


def test_a_mistral_window_that_would_slide_within_a_slot_is_a_config_error(tokenizer: Any) -> None:
    """Mistral attends to the last `sliding_window` positions; the native engine attends to
    all of them, so it takes Mistral only where the window cannot slide."""
    windowed = build(tokenizer, "tiny-mistral")
    windowed.config.sliding_window = 32
    with pytest.raises(ConfigError) as err:
        NativeModel(windowed, 64, path="stages.rollout.options")
    assert err.value.path == "stages.rollout.options.model" and "sliding window of 32" in str(
        err.value
    )
    NativeModel(windowed, 32)  # a slot within the window: exact


def test_release_refused_in_flight_then_sleep_and_wake(qwen: Any) -> None:
    eng = engine(qwen)
    req = Request(prompts(2), GREEDY, seed=0)
    rid = eng.add_request(req)
    with pytest.raises(BatchError, match="in flight"):
        eng.release()
    outs: list[Any] = []
    while eng.has_work():
        outs += eng.step()
    assert eng.release() > 0 and not eng.allocated
    with pytest.raises(BatchError, match="asleep"):
        eng.add_request(req)
    eng.allocate()
    (again,) = run_all(eng, [req])
    assert outs[0].request_id == rid and torch.equal(again.tokens, outs[0].tokens)

"""The vLLM rollout backend against plain HF on the same (resharded) weights.

(1) after streaming new weights in buckets, vLLM's greedy tokens equal HF `generate`'s;
(2) vLLM's sampling log-probs equal the actor's recomputation (HF forward, logits / T)
    within LOGPROB_TOL;
(3) n samples per prompt and EOS stopping give the layout the hf backend gives;
plus the failure modes: malformed prompts, incomplete weight updates.
"""

from __future__ import annotations

import pytest
import torch
from _policy import EOS, PAD, VOCAB, left_pad, policy, responses
from vllm_helpers import INITIAL_PROMPTS, MAX_NEW, make_ctx

from hybridflow.algos import logprobs_from_logits
from hybridflow.errors import BatchError

# fp32 on CPU, same weights: the two stacks differ only in kernels (vLLM's CPU attention
# and fused qkv/gate_up GEMMs vs torch's sdpa). Seen here: max |diff| ~1e-6.
LOGPROB_TOL = 1e-4


def perturbed(seed: int, scale: float = 0.05, eos_boost: float = 0.0):
    """The session model's initial weights plus seeded noise: 'the actor after a step'."""
    model = policy()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
        if eos_boost:
            # Tied embeddings: a larger EOS row makes the model emit EOS often.
            model.model.embed_tokens.weight[EOS] *= eos_boost
    return model


def reshard(rollout, model, per_bucket: int = 2, version: int = 1) -> dict[str, float]:
    """Stream the model's weights through the `load_weights` op in small buckets, so the
    q/k/v (and gate/up) tensors of one layer land in different buckets."""
    items = list(model.state_dict().items())
    metrics: dict[str, float] = {}
    for i in range(0, len(items), per_bucket):
        bucket = dict(items[i : i + per_bucket])
        last = i + per_bucket >= len(items)
        _, metrics = rollout.handle("load_weights", bucket, {"last": last, "version": version})
    return metrics


def some_prompts(seed: int, count: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 10, (count,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
        max_new_tokens=MAX_NEW,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )[0, len(prompt) :].tolist()
    return out[: out.index(EOS) + 1] if EOS in out else out


@torch.no_grad()
def actor_logprobs(
    model, out: dict[str, torch.Tensor], temperature: float, top_k: int = 0, top_p: float = 1.0
):
    """What the actor recomputes: one forward over [prompt | response] (left-padded prompt,
    positions from the mask), logits / T, log-prob of each response token. [B, R]"""
    ids = torch.cat([out["prompt_ids"], out["response_ids"]], dim=1)
    mask = torch.cat([out["prompt_mask"], out["response_mask"]], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    p, r = out["prompt_ids"].shape[1], out["response_ids"].shape[1]
    logits = logits[:, p - 1 : p + r - 1].float() / temperature  # logits[:, t] predicts token t
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:  # nucleus: drop a token once the mass before it reaches top_p
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logprobs_from_logits(logits, out["response_ids"], out["response_mask"])


def test_engine_starts_from_the_preset_weights(engine):
    """The engine loads the preset exactly as the hf roles build it (same run seed)."""
    assert responses(engine.initial) == [hf_greedy(policy(), p) for p in INITIAL_PROMPTS]


def test_greedy_tokens_equal_hf_generate_after_reshard(rollout):
    prompts = some_prompts(seed=1)
    ids, mask = left_pad(prompts)
    greedy = {"temperature": 0.0, "n": 1}

    model_a = perturbed(seed=11)
    reshard(rollout, model_a, version=1)
    out_a, metrics = rollout.handle("generate", {"prompt_ids": ids, "prompt_mask": mask}, greedy)
    assert responses(out_a) == [hf_greedy(model_a, p) for p in prompts]
    assert metrics["rollout/policy_version"] == 1.0
    # Greedy log-probs are reported at temperature 1 (as the hf backend does).
    valid = out_a["response_mask"].bool()
    diff = (out_a["rollout_logprobs"] - actor_logprobs(model_a, out_a, 1.0)).abs()[valid]
    assert diff.max().item() <= LOGPROB_TOL

    # A second reshard must take effect too (and not be served from the prefix cache).
    model_b = perturbed(seed=12)
    m = reshard(rollout, model_b, version=2)
    assert m["reshard/tensors"] == len(model_b.state_dict())
    out_b, _ = rollout.handle("generate", {"prompt_ids": ids, "prompt_mask": mask}, greedy)
    expected_b = [hf_greedy(model_b, p) for p in prompts]
    assert responses(out_b) == expected_b
    assert expected_b != responses(out_a), "the two weight sets should decode differently"


def test_in_process_handoff_matches_bucketed_reshard(rollout):
    prompts = some_prompts(seed=2)
    ids, mask = left_pad(prompts)
    model = perturbed(seed=21)
    # A generator, as a colocated actor would hand over (one tensor at a time).
    metrics = rollout.update_weights(((k, v) for k, v in model.state_dict().items()), version=3)
    assert metrics["reshard/bytes"] == sum(
        t.numel() * t.element_size() for t in model.state_dict().values()
    )
    out, _ = rollout.handle(
        "generate", {"prompt_ids": ids, "prompt_mask": mask}, {"temperature": 0.0}
    )
    assert responses(out) == [hf_greedy(model, p) for p in prompts]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 0, 1.0), (1.0, 0, 1.0), (1.3, 8, 1.0), (1.0, 0, 0.8)]
)
def test_sampling_logprobs_match_actor_recompute(rollout, temperature, top_k, top_p):
    """(2) Without top-k/top-p: exactly the actor's log_softmax(logits / T). With them:
    the same, renormalised over the kept tokens (the distribution actually sampled)."""
    model = perturbed(seed=31)
    reshard(rollout, model, per_bucket=5)
    ids, mask = left_pad(some_prompts(seed=3))
    out, _ = rollout.handle(
        "generate",
        {"prompt_ids": ids, "prompt_mask": mask},
        {"temperature": temperature, "top_k": top_k, "top_p": top_p, "n": 3, "seed": 7},
    )
    ref = actor_logprobs(model, out, temperature, top_k, top_p)
    valid = out["response_mask"].bool()
    diff = (out["rollout_logprobs"] - ref).abs()[valid]
    assert valid.sum() > 0 and torch.isfinite(out["rollout_logprobs"][valid]).all()
    assert diff.max().item() <= LOGPROB_TOL, f"max |vllm - actor| = {diff.max().item():.3g}"
    assert (out["rollout_logprobs"][~valid] == 0).all()
    # Not vacuous: the actor's numbers at a different temperature disagree.
    other = actor_logprobs(model, out, temperature * 2, top_k, top_p)
    assert (out["rollout_logprobs"] - other).abs()[valid].max() > 100 * LOGPROB_TOL


def test_n_samples_layout_and_eos_stop(rollout):
    model = perturbed(seed=41, eos_boost=10.0)
    reshard(rollout, model)
    prompts = some_prompts(seed=4, count=3)
    ids, mask = left_pad(prompts)
    n = 4
    rng = torch.random.get_rng_state()
    out, metrics = rollout.handle(
        "generate", {"prompt_ids": ids, "prompt_mask": mask}, {"n": n, "temperature": 1.0}
    )
    assert torch.equal(torch.random.get_rng_state(), rng), "sampling consumed the global RNG"
    rows = len(prompts) * n
    assert out["group_index"].tolist() == [i for i in range(len(prompts)) for _ in range(n)]
    assert torch.equal(out["prompt_ids"], ids.repeat_interleave(n, dim=0))
    assert torch.equal(out["prompt_mask"], mask.repeat_interleave(n, dim=0))
    for key in ("response_ids", "response_mask", "rollout_logprobs"):
        assert out[key].shape[0] == rows
    resp = responses(out)
    # Right padding: mask is 1..1 0..0, pad id after the end.
    m = out["response_mask"]
    assert not (m[:, 1:] > m[:, :-1]).any()
    assert (out["response_ids"][~m.bool()] == PAD).all()
    # EOS: a sample stops at its first EOS, which is kept (mask 1); a sample without EOS
    # runs to max_new_tokens; R is the longest sample.
    ended = [r for r in resp if r[-1] == EOS]
    assert ended and len(ended) < rows, "eos_boost should make some, not all, samples stop"
    for r in resp:
        assert EOS not in r[:-1]
        assert r[-1] == EOS or len(r) == MAX_NEW
    assert out["response_ids"].shape[1] == max(len(r) for r in resp)
    # n samples of a prompt are different draws, and the call is reproducible by seed.
    for g in range(len(prompts)):
        assert len({tuple(r) for r in resp[g * n : (g + 1) * n]}) > 1
    again, _ = rollout.handle(
        "generate",
        {"prompt_ids": ids, "prompt_mask": mask},
        {"n": n, "temperature": 1.0, "seed": 5},
    )
    again2, _ = rollout.handle(
        "generate",
        {"prompt_ids": ids, "prompt_mask": mask},
        {"n": n, "temperature": 1.0, "seed": 5},
    )
    assert torch.equal(again["response_ids"], again2["response_ids"])
    assert metrics["rollout/tokens"] == float(m.sum())


def _hf_backend(tmp_path):
    from hybridflow.stages.rollout.hf import HFRollout

    hf = HFRollout()
    vllm_only = ("max_model_len", "kv_cache_bytes")
    ctx = make_ctx(tmp_path)
    ctx.options = {k: v for k, v in ctx.options.items() if k not in vllm_only}
    hf.setup(ctx)
    return hf


def check_layout(out: dict[str, torch.Tensor], ids, mask, n: int) -> list[list[int]]:
    """The rollout contract both backends follow; returns the responses."""
    rows = ids.shape[0] * n
    assert out["group_index"].tolist() == [i for i in range(ids.shape[0]) for _ in range(n)]
    assert torch.equal(out["prompt_ids"], ids.repeat_interleave(n, dim=0))
    assert torch.equal(out["prompt_mask"], mask.repeat_interleave(n, dim=0))
    for key, dtype in (
        ("response_ids", torch.int64),
        ("response_mask", torch.int64),
        ("rollout_logprobs", torch.float32),
        ("group_index", torch.int64),
    ):
        assert out[key].shape[0] == rows and out[key].dtype == dtype, key
    m = out["response_mask"]
    assert not (m[:, 1:] > m[:, :-1]).any()  # right-padded
    assert (out["response_ids"][~m.bool()] == PAD).all()
    assert (out["rollout_logprobs"][~m.bool()] == 0).all()
    resp = responses(out)
    for r in resp:  # stops at its first EOS (kept, mask 1), else runs to max_new_tokens
        assert EOS not in r[:-1]
        assert r[-1] == EOS or len(r) == MAX_NEW
    assert out["response_ids"].shape[1] == max(len(r) for r in resp)
    return resp


def test_same_contract_and_greedy_output_as_hf_backend(rollout, tmp_path):
    """(3) the hf backend on the same weights: greedy outputs equal field by field; sampled
    outputs (different RNGs) follow the same layout, n and EOS rules."""
    hf = _hf_backend(tmp_path)
    model = perturbed(seed=61, eos_boost=10.0)
    items = list(model.state_dict().items())
    for backend in (hf, rollout):
        for i in range(0, len(items), 4):
            backend.handle("load_weights", dict(items[i : i + 4]), {"last": i + 4 >= len(items)})
    ids, mask = left_pad(some_prompts(seed=6, count=5))
    batch = {"prompt_ids": ids, "prompt_mask": mask}

    g_hf, _ = hf.handle("generate", batch, {"temperature": 0.0})
    g_vl, _ = rollout.handle("generate", batch, {"temperature": 0.0})
    resp = check_layout(g_vl, ids, mask, 1)
    assert any(r[-1] == EOS for r in resp) and any(len(r) == MAX_NEW for r in resp)
    assert g_hf.keys() == g_vl.keys()
    for key in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_index"):
        assert torch.equal(g_hf[key], g_vl[key]), key
    assert torch.allclose(g_hf["rollout_logprobs"], g_vl["rollout_logprobs"], atol=LOGPROB_TOL)

    n = 4
    s_hf, _ = hf.handle("generate", batch, {"temperature": 1.0, "n": n, "seed": 3})
    s_vl, _ = rollout.handle("generate", batch, {"temperature": 1.0, "n": n, "seed": 3})
    check_layout(s_hf, ids, mask, n)
    resp = check_layout(s_vl, ids, mask, n)
    ended = sum(r[-1] == EOS for r in resp)
    assert 0 < ended < len(resp), "eos_boost should make some, not all, samples stop"
    hf.close()


def test_malformed_prompts_are_rejected(rollout):
    ids, mask = left_pad([[5, 6, 7], [8, 9]])
    with pytest.raises(BatchError, match="left-padded"):
        rollout.handle("generate", {"prompt_ids": ids, "prompt_mask": mask.flip(1)}, {})
    with pytest.raises(BatchError, match="vocabulary"):
        rollout.handle("generate", {"prompt_ids": ids + VOCAB, "prompt_mask": mask}, {})
    with pytest.raises(BatchError, match="lacks"):
        rollout.handle("generate", {"prompt_ids": ids}, {})
    with pytest.raises(BatchError, match="max_model_len"):
        rollout.handle(
            "generate", {"prompt_ids": ids, "prompt_mask": mask}, {"max_new_tokens": 500}
        )
    with pytest.raises(BatchError, match="top_p"):
        rollout.handle("generate", {"prompt_ids": ids, "prompt_mask": mask}, {"top_p": 0.0})
    with pytest.raises(BatchError, match="unknown op"):
        rollout.handle("generat", {}, {})


def test_incomplete_weight_update_blocks_generation(rollout):
    from hybridflow.stages.rollout.vllm_compat import WeightSyncError

    ids, mask = left_pad([[5, 6, 7]])
    model = perturbed(seed=51)
    items = list(model.state_dict().items())
    # Buckets still open: generation must refuse.
    rollout.handle("load_weights", dict(items[:3]), {"last": False})
    with pytest.raises(BatchError, match="weight update is in progress"):
        rollout.handle("generate", {"prompt_ids": ids, "prompt_mask": mask}, {})
    # The last bucket arrives but a layer's tensor is missing: refused, and stays refused.
    missing = "model.layers.1.mlp.down_proj.weight"
    rest = {k: v for k, v in items[3:] if k != missing}
    with pytest.raises(WeightSyncError, match="down_proj"):
        rollout.handle("load_weights", rest, {"last": True})
    with pytest.raises(WeightSyncError, match="will not generate"):
        rollout.handle("generate", {"prompt_ids": ids, "prompt_mask": mask}, {})
    # Unknown names and wrong shapes are refused (BatchError, as in the hf backend).
    with pytest.raises(BatchError, match="no_such"):
        rollout.handle("load_weights", {"model.layers.0.no_such.weight": torch.zeros(2)}, {})
    name, tensor = items[0]
    with pytest.raises(BatchError):
        rollout.handle("load_weights", {name: tensor[:-1]}, {})
    with pytest.raises(WeightSyncError, match="will not generate"):
        rollout.handle("generate", {"prompt_ids": ids, "prompt_mask": mask}, {})
    # A complete update recovers.
    reshard(rollout, model)
    out, _ = rollout.handle(
        "generate", {"prompt_ids": ids, "prompt_mask": mask}, {"temperature": 0.0}
    )
    assert responses(out) == [hf_greedy(model, [5, 6, 7])]


def test_sleep_and_wake_are_skipped_on_cpu(rollout):
    assert rollout.handle("sleep", {}, {})[1] == {"rollout/sleep_skipped": 1.0}
    assert rollout.handle("wake_up", {}, {})[1] == {"rollout/wake_skipped": 1.0}

"""Packed forwards and token-budget micro-batches (stages/packing.py) equal the padded
row-count path: the actor's log-probs, entropy, loss metrics, gradients and update, the
reference's log-probs, the critic's values and update, and a LoRA actor's update.

Tolerance: packing changes only the shapes the kernels see (one [1, T] sequence instead of
[B, P + R] rows), so outputs agree to float32 rounding: 1e-5 absolute on log-probs,
entropy and values; gradients to rtol 1e-4 / atol 1e-6; parameter deltas after one AdamW
step (eps 1.0: linear in the gradient) to rtol 1e-4 / atol 1e-7.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from stage_helpers import TOK, make_role, sequences

from hybridflow.data.batching import pad_left
from hybridflow.errors import ConfigError
from hybridflow.stages.actor import Actor
from hybridflow.stages.critic import Critic
from hybridflow.stages.packing import (
    PackingOptions,
    check_packing,
    forward_groups,
    gather_rows,
    group_batch,
    pack_rows,
    padded_groups,
    response_span,
    row_groups,
    row_tokens,
)
from hybridflow.stages.reference import Reference
from hybridflow.stages.rollout.hf import HFRollout

# Prompts of 2 to 22 tokens, responses cut to 1 to 16 tokens (and one with an
# observation inside a multi-turn response): rows of very different lengths.
PROMPTS = ["a=", "copy:47=", "last:40719406719942=", "parity:1011010110=", "x:1="]
RESP_LEN = [16, 1, 9, 4, 16, 2, 12, 7, 16, 3]

PADDED = {"pack_sequences": False, "max_tokens_per_micro_batch": 0}
# (name, packing options): packed in one sequence, packed under a budget that splits the
# micro-batch into several groups, and the budget on the padded path alone.
VARIANTS = [
    ("packed", {"pack_sequences": True}),
    ("packed+budget", {"pack_sequences": True, "max_tokens_per_micro_batch": 40}),
    ("budget", {"max_tokens_per_micro_batch": 40}),
    # models/varlen.py: documents from cumulative lengths (its CPU reference path here)
    (
        "varlen+budget",
        {"pack_sequences": True, "max_tokens_per_micro_batch": 40, "attn_implementation": "varlen"},
    ),
]
ACTOR = {
    "model": "tiny",
    "lr": 1e-2,
    "eps": 1.0,  # AdamW's first step ~ lr * g: float noise stays small (see module doc)
    "temperature": 0.8,
    "entropy_coef": 0.01,
    "kl_loss_coef": 0.1,
}


@pytest.fixture(scope="module")
def batch():
    rollout = make_role(HFRollout, "rollout", {"model": "tiny", "n": 2, "max_new_tokens": 16})
    ids, mask = pad_left([TOK(t)["input_ids"] for t in PROMPTS], TOK.pad_token_id)
    out, _ = rollout.handle(
        "generate", {"prompt_ids": ids, "prompt_mask": mask}, {"step": 0, "mb_id": 0}
    )
    seqs = sequences(out)
    rm = seqs["response_mask"]
    rm[:] = 0
    for row, n in enumerate(RESP_LEN):
        rm[row, :n] = 1
    rm[6, 3:6] = 0  # an observation inside a multi-turn response: attended, not trained
    g = torch.Generator().manual_seed(0)
    shape = seqs["response_ids"].shape
    seqs["advantages"] = torch.randn(shape, generator=g) * rm
    seqs["returns"] = torch.randn(shape, generator=g)
    ref = make_role(Reference, "ref", {"model": "tiny", "temperature": 0.8})
    lp = ref.handle("get_logprob", seqs, {})[0]["ref_logprobs"]
    seqs["ref_logprobs"] = lp - 0.05 * seqs["advantages"].abs()
    return seqs


def _seqs(batch):
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    return {k: batch[k] for k in keys}


def test_the_packed_layout_has_the_padded_positions_and_predicting_tokens(batch):
    rows = pack_rows(batch, torch.device("cpu"))
    assert rows.input_ids.shape[1] == int(row_tokens(batch).sum())
    pos = rows.position_ids[0]
    starts = torch.nonzero(pos == 0).flatten()
    assert len(starts) == len(RESP_LEN)  # one document per row, positions restart
    # Each predicting position holds the token before the one it predicts.
    valid = batch["response_mask"] != 0
    targets = batch["response_ids"][valid]
    packed_ids = rows.input_ids[0]
    assert torch.equal(packed_ids[rows.predict + 1], targets)


@pytest.mark.parametrize("chunk", [0, 7])
@pytest.mark.parametrize(("name", "packing"), VARIANTS)
def test_actor_logprobs_and_entropy_packed_equal_padded(batch, chunk, name, packing):
    seqs = _seqs(batch)
    got = []
    for opts in (PADDED, packing):
        actor = make_role(Actor, "actor", {**ACTOR, **opts, "logprob_chunk_tokens": chunk})
        got.append(actor.handle("get_logprob", seqs, {})[0])
    for key in ("old_logprobs", "entropy"):
        torch.testing.assert_close(got[1][key], got[0][key], atol=1e-5, rtol=0, msg=key)
        assert bool((got[1][key][batch["response_mask"] == 0] == 0).all())


def _update(opts, mb, cls=Actor, base=ACTOR, before=None):
    role = make_role(cls, "role", {**base, **opts})
    if before is not None:  # after setup
        before()
    metrics = role.handle("update", mb, {})[1]
    if before is not None:  # the no-grad forwards too
        role.handle("get_logprob" if cls is Actor else "values", _seqs(mb), {})
    grads = {n: p.grad.clone() for n, p in role.model.named_parameters() if p.grad is not None}
    before = {k: v.clone() for k, v in role.model.state_dict().items()}
    step = role.handle("optimizer_step", {}, {})[1]
    after = role.model.state_dict()
    return metrics, grads, step, {k: after[k] - before[k] for k in after}


def _assert_same_update(got, want, rel=1e-5):
    (m1, g1, s1, d1), (m0, g0, s0, d0) = got, want
    assert set(g1) == set(g0) and g0
    for n, g in g0.items():
        torch.testing.assert_close(g1[n], g, atol=1e-6, rtol=1e-4, msg=n)
    for k in ("grad_norm", "pg_loss", "kl", "entropy", "vf_loss"):
        for prefix in ("actor", "critic"):
            if f"{prefix}/{k}" in s0:
                assert s1[f"{prefix}/{k}"] == pytest.approx(s0[f"{prefix}/{k}"], rel=rel), k
    assert any(bool(d.abs().max() > 0) for d in d0.values())  # it did train
    for k, d in d0.items():
        torch.testing.assert_close(d1[k], d, atol=1e-7, rtol=1e-4, msg=k)
    assert m0 and set(m1) == set(m0)


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize(("name", "packing"), VARIANTS)
def test_actor_update_packed_equals_padded(batch, agg, name, packing):
    """Loss aggregation sees the same per-token values, and the token-budget groups weigh
    their sum-form losses by the micro-batch's one denominator (trainer.py): the same
    gradients, metrics and parameter update as the padded whole micro-batch."""
    base = {**ACTOR, "loss_agg_mode": agg, "loss_norm_len": 16}
    want = _update(PADDED, batch, base=base)
    _assert_same_update(_update(packing, batch, base=base), want)


def test_actor_update_with_old_logprobs_computed_and_sft_packed(batch):
    mb = {k: v for k, v in batch.items() if k != "ref_logprobs"}
    base = {**ACTOR, "kl_loss_coef": 0.0, "logprob_chunk_tokens": 0}
    packing = {"pack_sequences": True, "max_tokens_per_micro_batch": 30}
    _assert_same_update(_update(packing, mb, base=base), _update(PADDED, mb, base=base))
    sft = [
        make_role(Actor, "actor", {"model": "tiny", **o}).handle("sft_update", _seqs(batch), {})[1]
        for o in (PADDED, packing)
    ]
    assert sft[1]["actor/sft_loss"] == pytest.approx(sft[0]["actor/sft_loss"], rel=1e-5)


@pytest.mark.parametrize(("name", "packing"), VARIANTS)
def test_reference_logprobs_packed_equal_padded(batch, name, packing):
    got = [
        make_role(Reference, "ref", {"model": "tiny", "temperature": 0.8, **o}).handle(
            "get_logprob", _seqs(batch), {}
        )[0]["ref_logprobs"]
        for o in (PADDED, packing)
    ]
    torch.testing.assert_close(got[1], got[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize(("name", "packing"), VARIANTS)
def test_critic_values_and_update_packed_equal_padded(batch, name, packing):
    base = {"model": "tiny", "lr": 1e-2, "eps": 1.0}
    values = [
        make_role(Critic, "critic", {**base, **o}).handle("values", _seqs(batch), {})[0]["values"]
        for o in (PADDED, packing)
    ]
    torch.testing.assert_close(values[1], values[0], atol=1e-5, rtol=0)
    mb = {**_seqs(batch), "returns": batch["returns"]}  # values computed in the update
    want = _update(PADDED, mb, cls=Critic, base=base)
    _assert_same_update(_update(packing, mb, cls=Critic, base=base), want)


@pytest.mark.parametrize("attn", ["sdpa", "varlen"])
def test_a_lora_actor_update_packed_equals_padded(batch, attn):
    """peft's wrapper in front of the model: the packed layout (and varlen's cumulative
    lengths, read from the wrapped config) still reach every layer."""
    pytest.importorskip("peft")
    base = {**ACTOR, "lora_rank": 4, "lora_alpha": 8.0}
    packing = {
        "pack_sequences": True,
        "max_tokens_per_micro_batch": 40,
        "attn_implementation": attn,
    }
    _assert_same_update(_update(packing, batch, base=base), _update(PADDED, batch, base=base))


# -- token-budget groups -----------------------------------------------------------------
def test_row_groups_fit_the_budget_and_a_longer_row_goes_alone():
    tokens = [3, 5, 2, 12, 4, 4, 1]
    assert list(row_groups(tokens, 10, 0)) == [slice(0, 3), slice(3, 4), slice(4, 7)]
    # Exact fits close a group at the budget; the next row opens one.
    assert list(row_groups([5, 5, 5, 5], 10, 0)) == [slice(0, 2), slice(2, 4)]
    assert list(row_groups([11, 11], 10, 0)) == [slice(0, 1), slice(1, 2)]
    # forward_batch_size still caps the rows of a group.
    assert list(row_groups([1] * 5, 100, 2)) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    # No budget: forward_batch_size rows (0: the whole micro-batch), as before.
    assert list(row_groups([1] * 5, 2, 0)) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert list(row_groups([1] * 5, 0, 0)) == [slice(0, 5)]


def test_padded_groups_bound_rows_times_the_widest_prompt_and_response():
    # widths: (prompt, span) per row; a group computes rows x (max prompt + max span)
    prompts, spans = [4, 2, 4, 1, 1], [6, 8, 3, 2, 2]
    # rows 0 and 1 hold 10 + 10 real tokens, but padded together 2 x (4 + 8) = 24 > 20;
    # rows 2-3 compute 2 x (4 + 3) = 14, and row 4 would make it 3 x 7 = 21
    assert list(padded_groups(prompts, spans, 20, 0)) == [
        slice(0, 1),
        slice(1, 2),
        slice(2, 4),
        slice(4, 5),
    ]
    assert list(padded_groups([4, 2], [6, 8], 20, 0)) == [slice(0, 1), slice(1, 2)]
    assert list(padded_groups([4, 4], [6, 6], 20, 0)) == [slice(0, 2)]  # 2 x 10 fits exactly
    assert list(padded_groups([30], [5], 20, 0)) == [slice(0, 1)]  # over the budget: alone
    assert list(padded_groups([1] * 5, [1] * 5, 100, 2)) == [slice(0, 2), slice(2, 4), slice(4, 5)]


def test_forward_groups_count_prompt_and_response_span_tokens(batch):
    tokens = row_tokens(batch)
    prompt = batch["prompt_mask"].sum(-1)
    assert int(tokens[6] - prompt[6]) == RESP_LEN[6]  # the observation's tokens count
    budget = int(tokens.max())  # the longest row fits exactly
    groups = list(forward_groups(batch, PackingOptions(max_tokens_per_micro_batch=budget), 0))
    # a partition of the rows, longest first (similar lengths share a padded forward)
    assert sorted(torch.cat(groups).tolist()) == list(range(len(RESP_LEN)))
    order = torch.cat(groups)
    assert tokens[order].tolist() == sorted(tokens.tolist(), reverse=True)
    assert all(int(tokens[g].sum()) <= budget for g in groups)
    assert len(groups) > 1
    # padded (the default): each forward computes <= budget positions, or is one row
    for g in groups:
        sub = group_batch(batch, g)
        width = sub["prompt_ids"].shape[1] + sub["response_ids"].shape[1]
        assert len(g) == 1 or len(g) * width <= budget
    # packed: real tokens, so the same budget can put more rows in a forward
    packed = list(
        forward_groups(
            batch, PackingOptions(max_tokens_per_micro_batch=budget, pack_sequences=True), 0
        )
    )
    assert all(int(tokens[g].sum()) <= budget for g in packed)
    assert len(packed) < len(groups)


def test_a_group_drops_the_padding_columns_none_of_its_rows_uses(batch):
    """group_batch cuts prompt columns before the group's longest prompt and response
    columns after its longest response span, in every value that wide; gather_rows puts
    [b, r] outputs back where the rows came from, zero-padded."""
    batch = {**batch, "advantages": torch.randn(batch["response_mask"].shape)}
    tokens = row_tokens(batch)
    short = torch.sort(tokens).indices[:2]  # the two shortest rows
    sub = group_batch(batch, short)
    span = int(response_span(batch["response_mask"][short]).sum(-1).max())
    longest_prompt = int(batch["prompt_mask"][short].sum(-1).max())
    assert sub["response_ids"].shape[1] == sub["advantages"].shape[1] == span
    assert sub["prompt_ids"].shape[1] == sub["prompt_mask"].shape[1] == longest_prompt
    assert torch.equal(sub["advantages"], batch["advantages"][short, :span])
    assert int(sub["prompt_mask"].sum()) == int(
        batch["prompt_mask"][short].sum()
    )  # no real token cut
    whole = group_batch(batch, torch.arange(len(RESP_LEN)))
    assert whole["response_ids"].shape == batch["response_ids"].shape  # the longest keeps all
    # consecutive rows (no budget) keep the micro-batch's width (measured faster on a GPU)
    first_two = group_batch(batch, slice(0, 2))
    assert first_two["response_ids"].shape[1] == batch["response_ids"].shape[1]
    r = batch["response_ids"].shape[1]
    rest = torch.tensor([i for i in range(len(RESP_LEN)) if i not in short.tolist()])
    out = gather_rows(
        [(short, torch.ones(2, span)), (rest, 2 * torch.ones(len(rest), r))], len(RESP_LEN), r
    )
    assert out[short, :span].eq(1).all() and out[short, span:].eq(0).all() and out[rest].eq(2).all()


# -- options ------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [Actor, Reference, Critic])
def test_a_negative_token_budget_names_the_key(cls):
    with pytest.raises(ConfigError, match=r"options\.max_tokens_per_micro_batch.*>= 0"):
        make_role(cls, "s", {"model": "tiny", "max_tokens_per_micro_batch": -1})


def test_bad_packing_values_are_config_errors():
    with pytest.raises(ConfigError, match="pack_sequences"):
        make_role(Actor, "s", {"model": "tiny", "pack_sequences": "yes"})
    with pytest.raises(ConfigError, match=r"x\.max_tokens_per_micro_batch.*sharded"):
        check_packing(PackingOptions(max_tokens_per_micro_batch=64), None, True, "x")

    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="paged|eager"))
    with pytest.raises(ConfigError, match=r"x\.pack_sequences.*paged\|eager"):
        check_packing(PackingOptions(pack_sequences=True), model, False, "x")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flex_attention)")
def test_packed_flex_attention_on_cuda_equals_padded_sdpa(batch):
    """The GPU path: FlexAttention's BlockMask from the packed position ids (no T x T)."""
    got = []
    for opts in (PADDED, {"pack_sequences": True, "attn_implementation": "flex_attention"}):
        actor = make_role(Actor, "actor", {**ACTOR, **opts}, device=torch.device("cuda:0"))
        got.append(actor.handle("get_logprob", _seqs(batch), {})[0]["old_logprobs"])
    torch.testing.assert_close(got[1], got[0], atol=1e-4, rtol=0)


def test_varlen_refuses_sliding_window_models_at_setup():
    """Mistral's kind (a window in the config, every layer) and Qwen2's (layer kinds;
    its config's `sliding_window` alone applies nowhere)."""
    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(_attn_implementation="varlen", sliding_window=4096)
    with pytest.raises(ConfigError, match=r"x\.attn_implementation.*sliding-window"):
        check_packing(PackingOptions(pack_sequences=True), model, False, "x")
    model.config.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(ConfigError, match="sliding-window"):
        check_packing(PackingOptions(pack_sequences=True), model, False, "x")
    model.config.layer_types = ["full_attention"]
    check_packing(PackingOptions(pack_sequences=True), model, False, "x")  # CPU: the reference
    check_packing(PackingOptions(pack_sequences=False), model, False, "x")


def test_a_packed_varlen_forward_takes_the_documents_path_and_no_mask(batch, monkeypatch):
    """The packed forward's attention runs per document from the cumulative lengths (the
    CPU reference here, the flash kernel on a GPU), once per layer, and transformers never
    looks for packed documents in the position ids (the all-ones mask keeps it from
    building its T x T mask)."""
    import transformers.masking_utils as mu

    from hybridflow.models import varlen

    calls = {"documents": 0, "mask_search": 0}
    reference, search = varlen.reference, mu.find_packed_sequence_indices

    def counted_reference(*args, **kwargs):
        calls["documents"] += 1
        return reference(*args, **kwargs)

    def counted_search(*args, **kwargs):
        calls["mask_search"] += 1
        return search(*args, **kwargs)

    monkeypatch.setattr(varlen, "reference", counted_reference)
    monkeypatch.setattr(mu, "find_packed_sequence_indices", counted_search)
    actor = make_role(
        Actor, "actor", {**ACTOR, "pack_sequences": True, "attn_implementation": "varlen"}
    )
    actor.handle("get_logprob", _seqs(batch), {})
    assert calls == {"documents": actor.model.config.num_hidden_layers, "mask_search": 0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flash varlen kernel)")
def test_packed_varlen_flash_on_cuda_equals_padded_sdpa_under_bf16(batch):
    """models/varlen.py's GPU path (bf16 activations under autocast reach torch's varlen
    flash kernel): log-probs and an update's metrics against the padded sdpa forward in
    the same precision; bf16 rounding differs between the kernels, hence 3e-2."""
    got = []
    for opts in (PADDED, {"pack_sequences": True, "attn_implementation": "varlen"}):
        o = {**ACTOR, **opts, "autocast_bf16": True}
        actor = make_role(Actor, "actor", o, device=torch.device("cuda:0"))
        lp = actor.handle("get_logprob", _seqs(batch), {})[0]["old_logprobs"]
        actor.handle("update", {**batch, "old_logprobs": lp}, {})
        got.append((lp, actor.handle("optimizer_step", {}, {})[1]))
    torch.testing.assert_close(got[1][0], got[0][0], atol=3e-2, rtol=0)
    (_, packed), (_, padded) = got
    assert packed["actor/skipped_updates"] == 0
    assert packed["actor/pg_loss"] == pytest.approx(padded["actor/pg_loss"], abs=3e-2)
    assert packed["actor/grad_norm"] == pytest.approx(padded["actor/grad_norm"], rel=5e-2)


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's own torch.jit use
@pytest.mark.filterwarnings("ignore:The .grad attribute:UserWarning")  # dynamo probes .grad
@pytest.mark.parametrize(
    "packing",
    [
        {"max_tokens_per_micro_batch": 40},
        {"max_tokens_per_micro_batch": 40, "pack_sequences": True, "attn_implementation": "varlen"},
    ],
    ids=["padded", "varlen"],
)
def test_compiled_layers_give_the_eager_update(batch, packing):
    """compile_layers (end of stages/packing.py) under a token budget (several group shapes, one
    dynamic compilation): the actor's gradients, metrics and step equal the eager ones
    (inductor's CPU backend here; CUDA's on the GPU). The reference and critic call the
    same function on the same layers; one compiled role keeps the suite's time down.

    Setup warms every variant (compile_layers given the role's forward): the budget's
    groups here include lone rows, unpadded and padded ones, and the update and
    get_logprob that follow compile no new graph; the warm-up's backward leaves no
    gradient behind (the grads equal eager's)."""
    from torch._dynamo.utils import counters

    budget = packing  # varlen: the documents' cumulative lengths reach the compiled layer
    want = _update(budget, batch)
    graphs = []
    got = _update(
        {**budget, "compile_layers": True},
        batch,
        before=lambda: graphs.append(counters["stats"]["unique_graphs"]),
    )
    graphs.append(counters["stats"]["unique_graphs"])
    _assert_same_update(got, want, rel=1e-4)
    assert graphs[0] > 0 and graphs[1] == graphs[0], graphs  # compiled at setup, not later


def test_compile_layers_with_fsdp_or_no_layers_names_the_key():
    from hybridflow.stages.packing import compile_layers

    with pytest.raises(ConfigError, match=r"actor\.compile_layers.*sharded"):
        compile_layers(True, torch.nn.Linear(2, 2), True, "actor")
    with pytest.raises(ConfigError, match=r"actor\.compile_layers.*no model.layers"):
        compile_layers(True, torch.nn.Linear(2, 2), False, "actor")
    assert compile_layers(False, torch.nn.Linear(2, 2), True, "actor") == 0


def _tiny_and_forward():
    from hybridflow.models.loader import ModelOptions, load_model
    from hybridflow.stages.common import response_logprobs

    model = load_model(ModelOptions(model="tiny", tokenizer="builtin"), TOK)
    return model, lambda b: response_logprobs(model, b, torch.device("cpu"), 1.0)[0]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing inductor (torch.jit)
def test_compile_layers_that_cannot_build_fall_back_to_eager_naming_the_key(caplog):
    """Where inductor cannot build (no C compiler on a slim GPU image), a preset with
    compile_layers on must still run: the warm-up's failure puts the layers back to eager,
    drops what the warm-up left, and warns with the key and inductor's cause. The failing
    compile is a stand-in at the forward's seam: it raises whenever a layer is compiled."""
    from hybridflow.stages.packing import compile_layers, decoder_layers

    model, forward = _tiny_and_forward()
    layers = decoder_layers(model)

    def run(group):
        if any(layer._compiled_call_impl is not None for layer in layers):
            raise RuntimeError(
                "backend='inductor' raised:\nRuntimeError: Failed to find C compiler"
            )
        return forward(group)

    with caplog.at_level("WARNING", logger="hybridflow.stages.packing"):
        assert (
            compile_layers(
                True, model, False, "stages.engine.roles.actor.options", run, (True, False)
            )
            == 0
        )
    assert all(layer._compiled_call_impl is None for layer in layers)
    assert all(p.grad is None for p in model.parameters())
    (record,) = caplog.records
    assert "stages.engine.roles.actor.options.compile_layers" in record.message
    assert "Failed to find C compiler" in record.message


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing inductor (torch.jit)
def test_a_warm_up_that_fails_eagerly_too_raises_its_own_error():
    """Not every warm-up failure is the compiler's: a forward that fails without compile
    raises its own error at setup, not a warning."""
    from hybridflow.stages.packing import compile_layers

    model, _ = _tiny_and_forward()

    def broken(group):
        raise ValueError("a bug in the role's forward")

    with pytest.raises(ValueError, match="a bug in the role's forward"):
        compile_layers(True, model, False, "actor", broken, (False,))

"""The native engine on CUDA: CUDA-graph decode gives the eager decode's tokens,
continuous batching through graph buckets, sleep frees memory, aliasing re-captures."""

from __future__ import annotations

import inspect
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from native_helpers import build, ctx, engine, prompts, run_all

from hybridflow.stages.rollout.native.kv_cache import Readback
from hybridflow.stages.rollout.native.request import Request, SamplingParams
from hybridflow.stages.rollout.native.role import NativeRollout

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen3", "tiny-mistral"])
def cuda_model(request: pytest.FixtureRequest, tokenizer: Any) -> Any:
    return build(tokenizer, request.param, device="cuda")


def _requests() -> list[Request]:
    return [Request([p.cuda() for p in prompts(k, seed=k)], GREEDY, seed=0) for k in (3, 6, 1)]


def test_graph_decode_equals_eager_decode(cuda_model: Any) -> None:
    reqs = _requests()
    eager_engine = engine(cuda_model, cuda_graphs=False)
    assert eager_engine.graphs is None
    eager = run_all(eager_engine, reqs)
    graphed_engine = engine(cuda_model, max_num_seqs=16, graph_batch_sizes=(2, 4, 8))
    assert graphed_engine.graphs is not None and graphed_engine.graphs.captured
    graphed = run_all(graphed_engine, reqs)
    for a, b in zip(eager, graphed, strict=True):
        assert torch.equal(a.tokens, b.tokens)
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_requests_joining_running_graph_steps_equal_alone(cuda_model: Any) -> None:
    reqs = _requests()
    alone = [run_all(engine(cuda_model), [r])[0].tokens for r in reqs]
    eng = engine(cuda_model, max_num_seqs=8)
    ids, outs = [eng.add_request(reqs[0])], {}
    for step in range(300):
        if step in (3, 7):
            ids.append(eng.add_request(reqs[len(ids)]))
        outs.update({o.request_id: o for o in eng.step()})
        if len(outs) == len(reqs):
            break
    for i, rid in enumerate(ids):
        assert torch.equal(outs[rid].tokens, alone[i])


def test_sampling_with_top_k_runs_in_graphs_and_is_seeded(cuda_model: Any) -> None:
    params = SamplingParams(temperature=1.0, top_k=5, top_p=0.9, max_new_tokens=16, n=4)
    req = Request([p.cuda() for p in prompts(2)], params, seed=11)
    a = run_all(engine(cuda_model), [req])[0]
    b = run_all(engine(cuda_model, cuda_graphs=False), [req])[0]
    assert torch.equal(a.tokens, b.tokens)


def test_release_frees_device_memory_and_allocate_recaptures(cuda_model: Any) -> None:
    eng = engine(cuda_model, kv_cache_gb=0.5, max_num_seqs=64)
    (ref,) = run_all(eng, _requests()[:1])
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    assert eng.release() > 0
    assert torch.cuda.memory_allocated() < held - eng.cache.nbytes // 2
    eng.allocate()
    assert eng.graphs is not None and eng.graphs.captured
    assert torch.equal(run_all(eng, _requests()[:1])[0].tokens, ref.tokens)
    assert eng.memory_stats()["peak_allocated_bytes"] > 0


def test_aliased_weights_recapture_graphs() -> None:
    r = NativeRollout()
    r.setup(
        ctx(
            {
                "max_new_tokens": 16,
                "max_prompt_len": 16,
                "kv_cache_gb": 0.05,
                "alias_weights": True,
            },
            "cuda",
        )
    )
    try:
        model = r.engine.core.model.hf  # type: ignore[union-attr]
        actor = {n: p.detach().clone() * 1.2 for n, p in model.named_parameters()}
        r.update_weights(iter(actor.items()), version=1)
        assert all(
            dict(model.named_parameters())[n].data_ptr() == t.data_ptr() for n, t in actor.items()
        )
        b = {
            "prompt_ids": torch.tensor([[5, 6, 7, 8]]),
            "prompt_mask": torch.ones(1, 4, dtype=torch.int64),
        }
        graphed = r.handle("generate", b, {"temperature": 0.0})[0]["response_ids"]
        eager = run_all(
            engine(model, cuda_graphs=False, max_model_len=32),
            [
                Request(
                    [torch.tensor([5, 6, 7, 8], device="cuda")],
                    SamplingParams(
                        temperature=0.0, max_new_tokens=16, stop_token_ids=tuple(r.eos_ids)
                    ),
                )
            ],
        )[0]
        n = int(eager.lengths[0])
        assert graphed[0, :n].tolist() == eager.tokens[0, :n].tolist()
    finally:
        r.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inductor's own torch.jit use
def test_compiled_fused_decode_in_graphs_equals_the_module_path(tokenizer: Any) -> None:
    """The fused path with its elementwise parts compiled, replayed from CUDA graphs, in
    float32 (greedy tokens and log-probs of the module path's eager decode) and bfloat16
    (greedy tokens: a bf16 rounding may flip a near tie, so most, not all)."""
    for dtype, exact in ((None, True), ("bfloat16", False)):
        kw = {} if dtype is None else {"dtype": dtype}
        model = build(tokenizer, "tiny-qwen3", device="cuda", **kw)
        reqs = _requests()
        module = run_all(engine(model, fused_decode=False, cuda_graphs=False), reqs)
        eng = engine(model, compile_decode=True, max_num_seqs=16, graph_batch_sizes=(2, 4, 8))
        assert eng.model.fused is not None and eng.model.fused.compiled
        assert eng.graphs is not None and eng.graphs.captured
        compiled = run_all(eng, reqs)
        same = sum(torch.equal(a.tokens, b.tokens) for a, b in zip(module, compiled, strict=True))
        if exact:
            assert same == len(reqs)
            for a, b in zip(module, compiled, strict=True):
                assert torch.allclose(a.logprobs, b.logprobs, atol=1e-4)
        else:
            assert same >= len(reqs) - 1


def test_paged_graph_decode_equals_slot_graph_decode(cuda_model: Any) -> None:
    """The Triton paged kernel inside the CUDA graphs gives the slot layout's tokens,
    also with too few blocks (rows preempted and recomputed), and so does the
    shared-prefix split forced on (4 of the 8 prompts hold a full block, shared by 3)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=40, n=3)
    reqs = [
        Request([p.cuda() for p in prompts(4, seed=k, lo=3, hi=20)], params, seed=k) for k in (1, 2)
    ]
    slot = run_all(engine(cuda_model, max_num_seqs=32, graph_batch_sizes=(8, 16)), reqs)
    for budget, split in ((0.05, False), (0.05, True), (None, True)):
        kw: dict[str, Any] = {"kv_block_size": 16, "max_num_seqs": 32, "graph_batch_sizes": (8, 16)}
        kw["shared_prefix_min_saved"] = 0 if split else 10**9
        if budget is None:  # 10 blocks for 24 rows of up to 70 positions
            probe = engine(cuda_model, **kw)
            assert probe.paged is not None and probe.paged.kernel
            kw["kv_cache_gb"] = (10 * probe.paged.block_bytes + 1) / float(1 << 30)
        eng = engine(cuda_model, **kw)
        assert eng.graphs is not None and eng.lengths == [eng.cache.max_len]
        out = run_all(eng, reqs)
        if budget is None:
            assert eng.stats["preemptions"] > 0
        assert (eng.stats["shared_prefix_rows"] > 0) is split
        for a, b in zip(slot, out, strict=True):
            assert torch.equal(a.tokens, b.tokens)
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=1e-4)


def test_lookahead_leaves_no_host_wait_but_the_readback(cuda_model: Any) -> None:
    """Rows finishing and queued rows joining (paged KV, graph buckets): the lookahead
    gives lockstep's tokens, and the only host waits left while it runs are the
    readback's (the snapshot's event, the finished rows' gathers): every other copy to or
    from the device is asynchronous (torch's sync debug mode)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=40, n=2, stop_token_ids=(7, 19, 33))
    reqs = [
        Request([p.cuda() for p in prompts(4, seed=k, lo=3, hi=24)], params, seed=k)
        for k in range(4)
    ]
    kw: dict[str, Any] = {"kv_block_size": 16, "max_num_seqs": 16, "graph_batch_sizes": (4, 8)}
    lockstep = run_all(engine(cuda_model, lookahead=False, **kw), reqs)
    eng = engine(cuda_model, lookahead=True, **kw)
    run_all(eng, reqs[:1])  # warm-up: kernels, the allocators' first blocks
    ids = [eng.add_request(r) for r in reqs]
    outs: dict[int, Any] = {}
    # Each sync warning with the Python stack it was raised under: torch reports a wait
    # in its own frames (an event's synchronize in torch/cuda/streams.py), so the test
    # asks whether the Readback's code is on the stack, not where the warning points.
    stacks: list[list[tuple[str, int]]] = []

    def keep(message: Any, *args: Any, **kw: Any) -> None:
        if "synchronizing" in str(message):
            stacks.append(
                [(Path(f.filename).name, f.lineno or 0) for f in traceback.extract_stack()]
            )

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = keep
            # inside the catch: turning the mode on warns that it is a prototype, which
            # the suite's warnings-as-errors would raise with the mode left on
            torch.cuda.set_sync_debug_mode("warn")
            while eng.has_work():
                outs.update({o.request_id: o for o in eng.step()})
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, b in zip(lockstep, (outs[i] for i in ids), strict=True):
        assert torch.equal(a.tokens, b.tokens)
    lines, first = inspect.getsourcelines(Readback)

    def readback(stack: list[tuple[str, int]]) -> bool:
        return any(f == "kv_cache.py" and first <= n < first + len(lines) for f, n in stack)

    assert stacks, "the sync debug mode reported nothing: the readback's waits are missing"
    others = [s[-6:] for s in stacks if not readback(s)]
    assert not others, others
    assert eng.stats["lookahead_rows"] > 0

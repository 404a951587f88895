"""Paged KV (`kv_block_size`): the same tokens and log-probs as the slot layout, blocks
shared by a prompt's samples, preemption that continues each row's stream, sessions,
block accounting under random traffic, and more rows than slots in the same memory."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from native_helpers import engine, prompts, run_all

from hybridflow.errors import ConfigError
from hybridflow.stages.rollout.native.engine import NativeEngine
from hybridflow.stages.rollout.native.forward.shared_prefix import prefix_groups
from hybridflow.stages.rollout.native.paged import PagedCache
from hybridflow.stages.rollout.native.request import Request, SamplingParams
from hybridflow.stages.rollout.native.scheduler import Blocks, Scheduler

GIB = float(1 << 30)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)


def paged(model: Any, blocks: int | None = None, **kw: Any) -> NativeEngine:
    """A paged engine of blocks of 16 positions; `blocks`: exactly that many in the pool
    (the scratch block included), else the helpers' 0.05 GiB."""
    if blocks is not None:
        probe = engine(model, kv_block_size=16, **kw)
        assert probe.paged is not None
        kw["kv_cache_gb"] = (blocks * probe.paged.block_bytes + 1) / GIB
    eng = engine(model, kv_block_size=16, **kw)
    assert eng.paged is not None and (blocks is None or eng.paged.num_blocks == blocks)
    return eng


def check_blocks(eng: NativeEngine) -> None:
    """Every block's count is the slots listing it; free blocks are listed nowhere; the
    device table says what the host lists say; only running or parked slots own any."""
    c = eng.paged
    assert c is not None and c.table is not None
    seen = [0] * c.num_blocks
    for blocks in c.owned:
        for b in blocks:
            seen[b] += 1
    assert seen[0] == 0 and seen == c.refs
    assert sorted(c.free_blocks) == [b for b in range(1, c.num_blocks) if seen[b] == 0]
    table = c.table.cpu()
    sch = eng.scheduler
    for s, blocks in enumerate(c.owned):
        assert table[s, : len(blocks)].tolist() == blocks and not table[s, len(blocks) :].any()
        if not blocks:
            continue
        assert s < sch.active or s >= sch.num_slots - len(sch.parked)
    if c.prefix_rows:  # the device's prefix groups are those of the host's lists, all running
        starts, entries = prefix_groups(c.owned, c.refs, c.block, c.prefix_rows)
        assert c.starts.tolist() == [starts.get(s, 0) for s in range(c.num_slots)]
        assert c.spans.tolist()[: len(entries)] == [n for _, n in entries]
        assert not c.spans[len(entries) :].any()
        for e, (rows, _) in enumerate(entries):
            assert c.members[e].tolist() == rows + [-1] * (c.prefix_rows - len(rows))
        assert all(s < sch.active for s in starts)


def equal_outputs(a: list[Any], b: list[Any], atol: float = 1e-5) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.tokens.tolist() == y.tokens.tolist()
        torch.testing.assert_close(x.logprobs, y.logprobs, atol=atol, rtol=1e-4)


def requests(seed: int, params: SamplingParams) -> list[Request]:
    # prompts up to 40 tokens: two full shared blocks and a tail for the longest
    return [Request(prompts(k, seed=seed + k, lo=3, hi=40), params, seed=k) for k in (3, 1, 2)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "module"])
def test_paged_gives_the_slot_layouts_tokens(model: Any, fused: bool) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=20, n=2)
    slot = run_all(engine(model, fused_decode=fused), requests(0, params))
    eng = paged(model, fused_decode=fused)
    equal_outputs(run_all(eng, requests(0, params)), slot)
    check_blocks(eng)
    assert eng.paged is not None and eng.paged.used_blocks == 0  # all given back


def test_sampled_rows_and_shared_prompt_blocks(qwen: Any) -> None:
    params = SamplingParams(temperature=0.9, top_k=20, max_new_tokens=20, n=4)
    reqs = [Request([p], params, seed=3) for p in prompts(2, seed=3, lo=33, hi=40)]
    slot = run_all(engine(qwen), reqs)
    eng = paged(qwen)
    ids = [eng.add_request(r) for r in reqs]
    eng.step()  # the admission: 2 prompts x 4 rows
    c = eng.paged
    assert c is not None and eng.scheduler.active == 8
    check_blocks(eng)
    for first in (0, 4):  # a prompt's rows share its 2 full blocks, each owns its tail
        owned = c.owned[first : first + 4]
        assert all(o[:2] == owned[0][:2] for o in owned)
        assert len({o[2] for o in owned}) == 4
        assert all(c.refs[b] == 4 for b in owned[0][:2])
    outs: dict[int, Any] = {}
    while eng.has_work():
        outs.update({o.request_id: o for o in eng.step()})
    equal_outputs([outs[i] for i in ids], slot)


def test_shared_prefix_attention_gives_what_each_row_reading_its_prefix_gives(qwen: Any) -> None:
    """Cascade decode (a prompt's rows read its shared blocks once per step) against
    every row reading its whole history, on the same paged layout: same tokens, log-probs
    within float rounding, and rows really read through groups."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=24, n=4)
    reqs = [Request(prompts(3, seed=5 + k, lo=16, hi=40), params, seed=k) for k in range(2)]
    plain = paged(qwen, shared_prefix=False)
    assert plain.paged is not None and plain.paged.prefix_rows == 0
    eng = paged(qwen, shared_prefix_min_saved=0)
    assert eng.paged is not None and eng.paged.prefix_rows > 1
    ids = [eng.add_request(r) for r in reqs]
    outs: dict[int, Any] = {}
    while eng.has_work():
        outs.update({o.request_id: o for o in eng.step()})
        check_blocks(eng)
    equal_outputs([outs[i] for i in ids], run_all(plain, reqs))
    assert eng.stats["shared_prefix_rows"] > eng.stats["decode_tokens"] // 2
    assert plain.stats["shared_prefix_rows"] == 0


def test_the_split_runs_only_while_it_saves_enough(qwen: Any) -> None:
    """The policy: 4 rows sharing 2 blocks save 3 x 32 = 96 positions over 4 rows (24
    each): the split runs at a threshold of 24, not at 25 (where the groups are still
    kept, for when it would pay)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=4, n=4)
    prompt = prompts(1, seed=2, lo=36, hi=36)
    for threshold, on in ((24, True), (25, False)):
        eng = paged(qwen, shared_prefix_min_saved=threshold)
        eng.add_request(Request(prompt, params))
        eng.step()
        assert eng.paged is not None and eng.paged.cascade is on
        assert eng.paged.starts[:4].tolist() == [32] * 4
        while eng.has_work():
            eng.step()
        assert (eng.stats["shared_prefix_rows"] > 0) is on
        assert not eng.paged.cascade  # nothing left to share


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_preempted_rows_continue_as_if_never_stopped(qwen: Any, temperature: float) -> None:
    params = SamplingParams(temperature=temperature, max_new_tokens=40, n=2)
    reqs = [Request(prompts(4, seed=9 + k, lo=5, hi=20), params, seed=k) for k in range(2)]
    whole = run_all(engine(qwen), reqs)
    # 16 rows of up to 60 positions: far fewer blocks than they need; the split forced
    # on (min_saved 0), so the prefix groups follow preemptions (check_blocks)
    eng = paged(qwen, blocks=12, shared_prefix_min_saved=0)
    ids = [eng.add_request(r) for r in reqs]
    outs: dict[int, Any] = {}
    while eng.has_work():
        outs.update({o.request_id: o for o in eng.step()})
        check_blocks(eng)
    assert eng.stats["preemptions"] > 0
    # recomputed K/V rounds differently from decoded K/V: tokens equal, log-probs close
    equal_outputs([outs[i] for i in ids], whole, atol=1e-4)
    assert eng.paged is not None and eng.paged.used_blocks == 0


def _turns(eng: NativeEngine, prompt: torch.Tensor, session: Any) -> list[list[int]]:
    out, obs = [], [[5, 6, 7], [9], [11, 12]]
    for k in range(len(obs) + 1):
        (o,) = run_all(
            eng, [Request([prompt], SamplingParams(0.0, max_new_tokens=6), session=session)]
        )
        toks = o.tokens[0, : int(o.lengths[0])]
        out.append(toks.tolist())
        if k < len(obs):
            prompt = torch.cat([prompt, toks, torch.tensor(obs[k])])
    return out


def test_sessions_park_their_blocks_and_continue_like_slots(qwen: Any) -> None:
    kept = paged(qwen, blocks=9)  # room for about two parked trajectories
    ref = engine(qwen, keep_sessions=False)
    for i, p in enumerate(prompts(3, seed=4, lo=10, hi=20)):
        assert _turns(kept, p, session=i) == _turns(ref, p, session=i)
        check_blocks(kept)
    assert kept.stats["reused_tokens"] > 0 and kept.stats["session_evictions"] > 0
    kept.drop_all_sessions()
    check_blocks(kept)
    assert kept.paged is not None and kept.paged.used_blocks == 0


@pytest.mark.parametrize("lookahead", [False, True], ids=["lockstep", "lookahead"])
def test_random_traffic_keeps_the_block_books(qwen: Any, lookahead: bool) -> None:
    g = torch.Generator().manual_seed(0)
    eng = paged(qwen, blocks=14, max_num_seqs=12, shared_prefix_min_saved=0, lookahead=lookahead)
    live: set[Any] = set()
    for it in range(40):
        if it % 3 == 0:
            n = int(torch.randint(1, 4, (1,), generator=g))
            params = SamplingParams(
                1.0, max_new_tokens=int(torch.randint(1, 30, (1,), generator=g)), n=n
            )
            eng.add_request(Request(prompts(2, seed=it, lo=2, hi=30), params, seed=it))
        if it % 5 == 1 and not any(s in live for s in (it,)):
            p = prompts(1, seed=100 + it, lo=5, hi=25)
            eng.add_request(Request(p, SamplingParams(1.0, max_new_tokens=8), seed=it, session=it))
            live.add(it)
        if it % 7 == 6:
            eng.drop_sessions(sorted(live)[:1])
            live = set(sorted(live)[1:])
        eng.step()
        check_blocks(eng)
    while eng.has_work():
        eng.step()
        check_blocks(eng)
    eng.drop_all_sessions()
    check_blocks(eng)
    assert eng.paged is not None and eng.paged.used_blocks == 0


def test_more_rows_fit_than_slots_in_the_same_memory(qwen: Any) -> None:
    slot = engine(qwen)  # made only for its slot size
    budget = 4 * slot.cache.slot_bytes / GIB  # four whole slots of 64 positions
    slots = engine(qwen, kv_cache_gb=budget, max_num_seqs=32)
    pages = engine(qwen, kv_cache_gb=budget, max_num_seqs=32, kv_block_size=16)
    assert slots.num_slots == 4
    params = SamplingParams(0.0, max_new_tokens=8)
    reqs = [Request(prompts(16, seed=1, lo=3, hi=6), params)]
    most = {}
    for name, eng in (("slots", slots), ("paged", pages)):
        eng.add_request(reqs[0])
        most[name] = 0
        while eng.has_work():
            eng.step()
            most[name] = max(most[name], eng.scheduler.active)
    # 15 blocks of 16 positions; a row holds at most 6 + 8: one block each
    assert most["slots"] == 4 and most["paged"] == 15 - 1  # the watermark: 1 block


def test_scheduler_admits_within_blocks_and_preempts_in_fifo_order() -> None:
    sch = Scheduler(8)
    sch.add(0, [20, 5], n=2)  # 20: 2 blocks of 16, the second row shares 1 and owns 1
    budget = Blocks(free=6, size=16, reserve=2)
    adm = sch.admit(1000, 0, budget)
    # rows of prompt 0 cost 2 + 1, prompt 1's first row 1: 2 left, the watermark
    assert [r.row for r in adm.rows] == [0, 1, 2] and budget.free == 2
    moves = sch.preempt({0: 3, 2: 1})  # slots 0 and 2; slot 1 moves down into slot 0
    assert moves == [(1, 0)] and [r.row for r in sch.slots] == [1]
    assert [r.row for r in sch.pending] == [0, 2, 3]
    adm = sch.admit(1000, 5, Blocks(free=20, size=16))
    assert [r.row for r in adm.rows] == [0, 2, 3]
    assert adm.resumed[0] is not None and adm.resumed[0].row == 0  # prompt 20 + 3 tokens
    assert sch.offsets[1:] == [20 + 3 - 5, 5 + 1 - 5, 5 - 5]


def test_bad_block_settings_name_the_option(qwen: Any) -> None:
    with pytest.raises(ConfigError, match="kv_block_size"):
        engine(qwen, kv_block_size=8)
    with pytest.raises(ConfigError, match=r"kv_cache_gb.*KV blocks"):
        paged(qwen, blocks=4)  # one 64-position sequence needs 4 blocks + the scratch one
    assert isinstance(paged(qwen, blocks=5).cache, PagedCache)


def test_the_role_runs_paged_and_validate_checks_its_budget(tokenizer: Any) -> None:
    from native_helpers import ctx

    from hybridflow.stages.rollout.native import limits
    from hybridflow.stages.rollout.native.role import NativeRollout, NativeRolloutOptions

    opts = {"max_new_tokens": 8, "max_prompt_len": 24, "kv_block_size": 16, "kv_cache_gb": 0.01}
    role = NativeRollout()
    role.setup(ctx(opts))
    assert role.engine.core.paged is not None
    bad = NativeRolloutOptions(**{**opts, "kv_block_size": 24, "model": "tiny"})
    with pytest.raises(ConfigError, match=r"rollout\.kv_block_size"):
        bad.validate("rollout")
    tight = NativeRolloutOptions(**{**opts, "kv_cache_gb": 1e-6, "model": "tiny"})
    with pytest.raises(ConfigError, match="kv_cache_gb"):
        limits.check(tight, limits.model_facts(tight, "rollout"), "rollout")

"""The trajectory loop (stages/rollout/multiturn.py) against a scripted engine: token
continuity, masks, limits, environment errors and bounds, metrics. No model runs here."""

from __future__ import annotations

import asyncio

import pytest
from mt_helpers import CountdownEnv, ScriptedEngine, chat_tokenizer, countdown_records

from hybridflow.errors import BatchError, ConfigError
from hybridflow.stages.env.protocol import EnvError, EnvTimeout
from hybridflow.stages.rollout.multiturn import MultiTurnConfig, TrajectoryLoop

TOK = chat_tokenizer()
EOS = TOK.eos_token_id


def make_loop(env="mt_helpers:CountdownEnv", position_limit=512, **kw):
    cfg = dict(
        env=env,
        env_options={},
        max_turns=8,
        max_total_tokens=0,
        env_timeout_s=5.0,
        env_concurrency=32,
        tool_parser="",
    )
    cfg.update(kw)
    return TrajectoryLoop(
        MultiTurnConfig(**cfg), TOK, [EOS], position_limit=position_limit, path="opts"
    )


def prompts_of(records):
    return [
        TOK.encode(
            TOK.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for r in records
    ]


def run(loop, records, engine=None, max_new_tokens=8):
    CountdownEnv.reset_counters()
    engine = engine or ScriptedEngine(EOS)
    metas = [{k: v for k, v in r.items() if k != "prompt"} for r in records]
    result = asyncio.run(loop.run(engine, prompts_of(records), metas, max_new_tokens))
    return result, engine


def test_token_in_token_out_and_masks():
    records = countdown_records([1, 3, 2])
    result, engine = run(make_loop(), records)
    assert [lay.num_turns for lay in result.layouts] == [1, 3, 2]
    assert result.env_reward == [1.0, 3.0, 2.0]
    prompts = prompts_of(records)
    for b, lay in enumerate(result.layouts):
        # the reference: the whole conversation templated once, minus its final "\n"
        conversation = list(records[b]["prompt"])
        for k in range(lay.num_turns):
            conversation.append({"role": "assistant", "content": TOK.decode([100 + b, 110 + k])})
            if k < lay.num_turns - 1:
                conversation.append({"role": "user", "content": f"ok {k + 1}"})
        reference = TOK.encode(
            TOK.apply_chat_template(conversation, tokenize=False), add_special_tokens=False
        )
        assert prompts[b] + lay.response_ids == reference[:-1]
        model = [t for t, m in zip(lay.response_ids, lay.response_mask, strict=True) if m]
        assert model == [i for k in range(lay.num_turns) for i in (100 + b, 110 + k, EOS)]
        assert all(
            (lp == -0.5) == bool(m)
            for lp, m in zip(lay.rollout_logprobs, lay.response_mask, strict=True)
        )
    # turn k+1's context = turn k's context + its generated ids + the observation ids
    by_key = {}
    for _, req in engine.requests:
        by_key.setdefault(req.key, []).append(req)
    for key, reqs in by_key.items():
        assert reqs[0].context_ids == prompts[key] and reqs[0].appended == len(prompts[key])
        for k in range(1, len(reqs)):
            prev, cur = reqs[k - 1], reqs[k]
            assert cur.context_ids[: len(prev.context_ids)] == prev.context_ids
            new = cur.context_ids[len(prev.context_ids) :]
            obs = TOK.encode(f"\nuser:\nok {k}<eos>\nassistant:\n", add_special_tokens=False)
            assert new == [100 + key, 110 + k - 1, EOS, *obs] and cur.appended == len(new)
    assert CountdownEnv.closed == 3


def test_metrics():
    result, _ = run(make_loop(), countdown_records([1, 3]))
    m = result.metrics
    assert m["rollout/turns/mean"] == 2.0
    assert m["rollout/tool_calls"] == 2.0  # (1 + 3) / 2 trajectories
    assert m["rollout/tool_errors"] == 1.5  # odd turns: 1 + 2, over 2 trajectories
    obs = sum(lay.observation_tokens for lay in result.layouts)
    total = sum(len(lay.response_ids) for lay in result.layouts)
    assert obs > 0 and m["rollout/obs_token_frac"] == pytest.approx(obs / total)
    assert m["rollout/truncated_frac"] == 0.0
    assert m["rollout/env_reward/mean"] == 2.0
    assert m["env/step_s"] >= 0 and m["env/wait_s"] >= 0
    assert m["rollout/appended_tokens"] < m["rollout/context_tokens"]


def test_max_turns_ends_trajectories_and_counts_them():
    result, _ = run(make_loop(max_turns=2), countdown_records([1, 5]))
    assert [lay.num_turns for lay in result.layouts] == [1, 2]
    assert result.env_reward == [1.0, 0.0]  # the cut trajectory never reached its reward
    assert result.metrics["rollout/truncated_frac"] == 0.5
    assert result.layouts[1].response_mask[-1] == 1  # ends on a model token


def test_max_total_tokens_bounds_every_context():
    records = countdown_records([6, 6])
    limit = max(len(p) for p in prompts_of(records)) + 20
    result, engine = run(make_loop(max_total_tokens=limit), records)
    for _, req in engine.requests:
        assert len(req.context_ids) + req.max_new_tokens <= limit
    for b, lay in enumerate(result.layouts):
        assert len(prompts_of(records)[b]) + len(lay.response_ids) <= limit
        assert 1 <= lay.num_turns < 6
    assert result.metrics["rollout/truncated_frac"] == 1.0


def test_a_prompt_without_room_is_an_error():
    records = countdown_records([1])
    with pytest.raises(BatchError, match="max_total_tokens"):
        run(make_loop(max_total_tokens=len(prompts_of(records)[0])), records)


def test_truncated_turns_are_closed_before_the_observation():
    result, _ = run(make_loop(), countdown_records([2]), ScriptedEngine(EOS, cut=3))
    lay = result.layouts[0]
    # the cut turn had no stop token: the observation starts with the template's <eos>
    obs = [t for t, m in zip(lay.response_ids, lay.response_mask, strict=True) if not m]
    assert obs[0] == EOS
    assert TOK.decode(obs).startswith("<eos>\nuser:\nok 1")


def test_env_calls_are_bounded_and_concurrent():
    loop = make_loop(env_options={"delay_s": 0.2}, env_concurrency=3)
    result, _ = run(loop, countdown_records([1] * 8))
    assert CountdownEnv.peak == 3
    # 8 steps of 0.2 s, 3 at a time: 3 rounds, not 8
    assert result.metrics["env/wait_s"] < 8 * 0.2


def test_a_failing_step_names_row_turn_and_call_and_closes_every_env():
    with pytest.raises(EnvError, match=r"row 1 turn 1: CountdownEnv.step raised RuntimeError"):
        run(make_loop(env_options={"fail_at": 2}), countdown_records([1, 3]))
    assert CountdownEnv.closed == 2


def test_a_slow_env_is_a_named_timeout():
    loop = make_loop(env="mt_helpers:SlowResetEnv", env_timeout_s=0.2)
    with pytest.raises(
        EnvTimeout, match=r"row 0: SlowResetEnv.reset did not return within 0.2 s .*env_timeout_s"
    ):
        run(loop, countdown_records([1]))


def test_reset_messages_replace_the_prompt():
    result, _ = run(make_loop(env="mt_helpers:MessagesResetEnv"), countdown_records([1, 2]))
    assert result.prompt_replaced
    want = TOK.encode(
        TOK.apply_chat_template(
            [{"role": "user", "content": "A new prompt."}],
            tokenize=False,
            add_generation_prompt=True,
        ),
        add_special_tokens=False,
    )
    assert result.prompts == [want, want]
    assert result.tensors(TOK.pad_token_id)["prompt_ids"].shape[0] == 2


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"opts.env_options.dely_s: unknown option.*delay_s"):
        make_loop(env_options={"dely_s": 1})
    with pytest.raises(ConfigError, match=r"opts.tool_parser: .*guess_number takes no `parser`"):
        make_loop(env="guess_number", tool_parser="hermes")
    loop = make_loop(env="calculator", tool_parser="hermes")  # ToolEnv takes `parser`
    assert loop.factory().parser is not None


def test_an_observation_outside_the_vocabulary_is_a_named_error():
    with pytest.raises(
        EnvError, match=r"row 0 turn 0: BadTokensEnv.step's observation: .*vocabulary"
    ):
        run(make_loop(env="mt_helpers:BadTokensEnv"), countdown_records([3]))
    assert CountdownEnv.closed == 1

"""The foundation end to end, driven by a scripted policy the way the rollout stage's
trajectory loop will drive it: factory -> reset -> (turn, step, observation ids)* ->
layout. The ids the loop accumulates must equal the chat template's rendering of the
whole conversation, tokenized once (token-in/token-out loses or adds nothing)."""

from __future__ import annotations

import json

from env_helpers import chatml_tokenizer, encode, simple_tokenizer

from hybridflow.stages.env.layout import Trajectory
from hybridflow.stages.env.observations import ObservationEncoder
from hybridflow.stages.env.protocol import Action, ObservationKind, call, close_env
from hybridflow.stages.env.registry import make_env_factory


async def run_scripted(env, record, tok, prompt, turns, stop_id):
    """A stand-in for the trajectory loop: the 'engine' emits each scripted text plus
    the stop token. Returns (trajectory, step results, the conversation as messages)."""
    first = await call(env.reset, record)
    assert first.kind is ObservationKind.EMPTY
    tools = env.tools_schema() if hasattr(env, "tools_schema") else None
    enc = ObservationEncoder(tok, tools=tools, stop_token_ids=[stop_id])
    traj = Trajectory(enc.prompt_ids(prompt))
    conversation = list(prompt)
    results = []
    for text in turns:
        ids = [*encode(tok, text), stop_id]
        traj.add_turn(ids, [-0.5] * len(ids))
        conversation.append({"role": "assistant", "content": text})
        result = await call(env.step, Action(text, tuple(ids)), timeout_s=10)
        results.append(result)
        if result.done:
            break
        traj.add_observation(enc.encode(result.observation))
        conversation += list(result.observation.messages)
    await close_env(env)
    return traj, results, conversation, tools


def calc_call(expression: str) -> str:
    return (
        "<tool_call>"
        + json.dumps({"name": "calc", "arguments": {"expression": expression}})
        + "</tool_call>"
    )


async def test_calculator_trajectory_token_continuity_masks_and_reward():
    tok = chatml_tokenizer()
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    record = {
        "data_source": "hybridflow/word_problems",
        "reward_model": {"ground_truth": "12"},
        "extra_info": {"index": 0},
    }
    prompt = [{"role": "user", "content": "Ann has 7 apples. She buys 5 more. How many?"}]
    turns = [
        "Let me add. " + calc_call("7 + 5"),
        calc_call("7 +") + calc_call("12 * 1"),
        "Ann has 12 apples.\n#### 12",
    ]
    env = make_env_factory("calculator", {"max_turns": 4})()
    traj, results, conversation, tools = await run_scripted(env, record, tok, prompt, turns, stop)

    assert [r.done for r in results] == [False, False, True]
    assert results[-1].reward == 1.0
    assert sum(r.info["tool_calls"] for r in results) == 3
    assert sum(r.info["tool_errors"] for r in results) == 1
    tool_said = [m["content"] for m in conversation if m["role"] == "tool"]
    assert tool_said[0] == tool_said[2] == "12"
    assert "not an arithmetic expression" in tool_said[1]

    # token continuity: the accumulated ids are the template's whole conversation
    reference = encode(tok, tok.apply_chat_template(conversation, tools=tools, tokenize=False))
    assert traj.context_ids() == reference[:-1]  # minus the "\n" after the last <|im_end|>

    # masks: 1 exactly on the scripted turns' ids, 0 on everything the env added
    layout = traj.layout()
    assert layout.num_turns == 3
    generated = [t for t, m in zip(layout.response_ids, layout.response_mask, strict=True) if m]
    assert generated == [i for text in turns for i in (*encode(tok, text), stop)]
    observed = [t for t, m in zip(layout.response_ids, layout.response_mask, strict=True) if not m]
    assert "<tool_response>\n12\n</tool_response>" in tok.decode(observed)
    assert "Error:" in tok.decode(observed)  # the malformed expression, shown to the model
    assert all(
        (lp == -0.5) == bool(m)
        for lp, m in zip(layout.rollout_logprobs, layout.response_mask, strict=True)
    )


async def test_guess_number_trajectory_with_user_feedback():
    tok = simple_tokenizer()
    record = {"reward_model": {"ground_truth": "37"}, "extra_info": {"low": 1, "high": 100}}
    prompt = [{"role": "user", "content": "Guess my number from 1 to 100."}]
    env = make_env_factory("guess_number", {"max_turns": 7})()
    traj, results, conversation, _ = await run_scripted(
        env, record, tok, prompt, ["50", "25", "37"], tok.eos_token_id
    )
    assert [r.reward for r in results] == [0.0, 0.0, 1.0]
    assert [m["content"] for m in conversation if m["role"] == "user"][1:] == [
        "Lower. 6 guesses left.",
        "Higher. 5 guesses left.",
    ]
    reference = encode(tok, tok.apply_chat_template(conversation, tokenize=False))
    assert traj.context_ids() == reference[:-1]
    assert traj.layout().observation_tokens == len(
        encode(tok, "\nuser:\nLower. 6 guesses left.<eos>\nassistant:\n")
    ) + len(encode(tok, "\nuser:\nHigher. 5 guesses left.<eos>\nassistant:\n"))

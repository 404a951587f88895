"""Observation tokenization: only the observation is templated, as the delta the chat
template itself adds after an assistant turn; loud errors for templates where that is
not exact; plain text without a template; token ids passed through."""

from __future__ import annotations

import pytest
from env_helpers import chatml_tokenizer, encode, simple_tokenizer

from hybridflow.errors import ConfigError
from hybridflow.models.tokenizer import CHAT_TEMPLATE, builtin_tokenizer
from hybridflow.stages.env.observations import ObservationEncoder
from hybridflow.stages.env.protocol import Observation

TOOL_12 = Observation.from_messages([{"role": "tool", "name": "calc", "content": "12"}])


def im_end(tok) -> int:
    return tok.convert_tokens_to_ids("<|im_end|>")


def test_chatml_delta_is_the_observation_turn_plus_the_generation_prompt():
    tok = chatml_tokenizer()
    enc = ObservationEncoder(tok, stop_token_ids=[im_end(tok)])
    two = Observation.from_messages(
        [{"role": "tool", "content": "12"}, {"role": "tool", "content": "3"}]
    )
    expected = (
        "\n<|im_start|>user\n<tool_response>\n12\n</tool_response>\n"
        "<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(enc.encode(two)) == expected
    assert enc.encode(two) == encode(tok, expected)
    assert enc.after_stop_ids == encode(tok, "\n")


def test_a_turn_end_that_is_no_stop_token_is_refused():
    # the ChatML tokenizer's EOS is <eos>; its turns end with <|im_end|>
    with pytest.raises(ConfigError, match="pass the id that ends a model turn as stop_token_ids"):
        ObservationEncoder(chatml_tokenizer())


def test_an_unclosed_turn_is_closed_first():
    tok = chatml_tokenizer()
    enc = ObservationEncoder(tok, stop_token_ids=[im_end(tok)])
    closed, unclosed = enc.encode(TOOL_12), enc.encode(TOOL_12, closed=False)
    assert unclosed == [im_end(tok), *closed]


def test_continuity_against_the_template_rendering_the_whole_conversation():
    """prompt + gen_1 + obs_1 + gen_2, each tokenized alone, is exactly the template's
    rendering of the whole conversation, tokenized (minus the "\\n" after the last
    <|im_end|>, which the model never generates)."""
    tok = chatml_tokenizer()
    end = im_end(tok)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    enc = ObservationEncoder(tok, tools=tools, stop_token_ids=[end])
    conversation = [
        {"role": "user", "content": "Ann has 7 apples. She buys 5 more."},
        {"role": "assistant", "content": "Let me add."},
        {"role": "tool", "content": "12"},
        {"role": "tool", "content": "12"},
        {"role": "assistant", "content": "The answer is 12."},
    ]
    ids = enc.prompt_ids(conversation[:1])
    ids += [*encode(tok, "Let me add."), end]
    ids += enc.encode(Observation.from_messages(conversation[2:4]))
    ids += [*encode(tok, "The answer is 12."), end]
    full = tok.apply_chat_template(conversation, tools=tools, tokenize=False)
    reference = encode(tok, full)
    assert tok.decode(reference[-1:]) == "\n"
    assert ids == reference[:-1]
    assert '"name": "calc"' in tok.decode(ids)  # the tools reached the prompt


def test_builtin_tokenizer_with_a_small_template():
    tok = simple_tokenizer()
    enc = ObservationEncoder(tok)
    assert tok.decode(enc.encode(TOOL_12)) == "\ntool:\n12<eos>\nassistant:\n"
    conversation = [
        {"role": "user", "content": "What is 7+5?"},
        {"role": "assistant", "content": "Let me think."},
        {"role": "tool", "content": "12"},
        {"role": "assistant", "content": "The answer is 12."},
    ]
    ids = [*enc.prompt_ids(conversation[:1]), *encode(tok, "Let me think."), tok.eos_token_id]
    ids += enc.encode(Observation.from_messages(conversation[2:3]))
    ids += [*encode(tok, "The answer is 12."), tok.eos_token_id]
    reference = encode(tok, tok.apply_chat_template(conversation, tokenize=False))
    assert ids == reference[:-1]


def test_equal_observations_give_equal_ids_whatever_came_before():
    tok = chatml_tokenizer()
    enc = ObservationEncoder(tok, stop_token_ids=[im_end(tok)])
    first = enc.encode(TOOL_12)
    enc.encode(Observation.from_messages([{"role": "user", "content": "Lower."}]))
    assert enc.encode(TOOL_12) == first


def test_a_template_that_is_not_prefix_stable_is_refused():
    tok = builtin_tokenizer()
    # renders the last message differently (like templates that strip reasoning from
    # every assistant turn but the last one)
    tok.chat_template = (
        "{%- for m in messages -%}"
        "{%- if loop.last -%}{{- '[last] ' -}}{%- endif -%}"
        "{{- m.role + ': ' + m.content + eos_token -}}"
        "{%- endfor -%}"
    )
    enc = ObservationEncoder(tok)
    with pytest.raises(ConfigError, match="not prefix-stable") as exc:
        enc.encode(TOOL_12)
    assert exc.value.path == "tokenizer.chat_template"


class MergingTokenizer:
    """A tokenizer seam fake: characters, except that "." merges with the letter after
    it into one token (a BPE merge across the end of an assistant turn)."""

    chat_template = "fake"
    eos_token_id = None

    def __len__(self) -> int:
        return 1 << 17

    def apply_chat_template(
        self, messages, tools=None, tokenize=False, add_generation_prompt=False
    ):
        return "".join(m["content"] for m in messages) + (">" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            if text[i] == "." and i + 1 < len(text) and text[i + 1].isalpha():
                out.append(1000 + ord(text[i + 1]))
                i += 2
            else:
                out.append(ord(text[i]))
                i += 1
        return out


def test_a_merge_across_the_turn_boundary_is_refused():
    enc = ObservationEncoder(MergingTokenizer())
    assert enc.encode(Observation.from_messages([{"role": "tool", "content": "12"}])) == [
        ord("1"),
        ord("2"),
        ord(">"),
    ]
    with pytest.raises(ConfigError, match="merges tokens across the end of an assistant turn"):
        enc.encode(Observation.from_messages([{"role": "tool", "content": "abc"}]))


def test_a_template_that_cannot_render_the_role_is_a_config_error():
    tok = builtin_tokenizer()
    tok.chat_template = CHAT_TEMPLATE  # raises on roles other than system/user/assistant
    enc = ObservationEncoder(tok)
    with pytest.raises(
        ConfigError, match=r"roles \['user', 'assistant', 'tool'\].*unknown chat role"
    ):
        enc.encode(TOOL_12)


def test_without_a_template_content_is_plain_text_with_a_newline():
    tok = builtin_tokenizer()
    assert not tok.chat_template
    enc = ObservationEncoder(tok)
    obs = Observation.from_messages(
        [{"role": "tool", "content": "12"}, {"role": "user", "content": "Lower."}]
    )
    ids = enc.encode(obs)
    assert tok.decode(ids) == "12\nLower.\n"
    assert tok.bos_token_id not in ids and tok.eos_token_id not in ids
    assert enc.prompt_ids([{"role": "user", "content": "Guess."}]) == encode(tok, "Guess.\n")
    with pytest.raises(ConfigError, match="no chat template"):
        ObservationEncoder(tok, use_chat_template=True)
    templated = simple_tokenizer()
    assert ObservationEncoder(templated, use_chat_template=False).encode(obs) == ids


def test_token_observations_pass_through_and_are_checked():
    tok = simple_tokenizer()
    enc = ObservationEncoder(tok)
    assert enc.encode(Observation.from_tokens([5, 6, 7])) == [5, 6, 7]
    assert enc.encode(Observation.empty()) == []
    with pytest.raises(ValueError, match="outside the vocabulary"):
        enc.encode(Observation.from_tokens([5, len(tok)]))

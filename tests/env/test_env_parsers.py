"""The hermes tool-call parser: what it accepts, what it rejects (as errors, never
exceptions), its bounds, and the parser registry."""

from __future__ import annotations

import pytest

from hybridflow.errors import ConfigError
from hybridflow.stages.env.parsers import (
    HermesParser,
    ParseError,
    ToolCall,
    get_parser,
    register_parser,
)

P = HermesParser()


def one_error(text: str) -> str:
    turn = P.parse(text)
    assert turn.calls == ()
    assert len(turn.errors) == 1, turn.errors
    return turn.errors[0].message()


def test_a_valid_call_and_the_content_around_it():
    turn = P.parse(
        'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "3*4"}}\n'
        "</tool_call>\nDone."
    )
    assert turn.calls == (ToolCall("calc", {"expression": "3*4"}),)
    assert turn.errors == ()
    assert turn.content == "Let me compute.\n\nDone."
    assert turn.attempted


def test_several_calls_keep_their_order_with_errors_in_between():
    turn = P.parse(
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
        "<tool_call>{not json}</tool_call>"
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    kinds = [type(i).__name__ for i in turn.items]
    assert kinds == ["ToolCall", "ParseError", "ToolCall"]
    assert [c.name for c in turn.calls] == ["a", "b"]
    assert turn.calls[0].arguments == {"x": 1}


def test_no_call_is_no_attempt():
    turn = P.parse("The answer is 12.\n#### 12")
    assert not turn.attempted
    assert turn.content == "The answer is 12.\n#### 12"


def test_arguments_as_a_json_string_are_decoded():
    turn = P.parse(
        '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1+2\\"}"}</tool_call>'
    )
    assert turn.calls == (ToolCall("calc", {"expression": "1+2"}),)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("{not json}", "not valid JSON"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": 3, "arguments": {}}', "must be a function name"),
        ('{"name": "rm -rf /", "arguments": {}}', "must be a function name"),
        ('{"name": "calc"}', 'no "arguments"'),
        ('{"name": "calc", "arguments": [1, 2]}', "must be a JSON object"),
        ('{"name": "calc", "arguments": "not an object"}', "string that is not a JSON object"),
        ('{"name": "calc", "arguments": "[1]"}', "must be a JSON object"),
        ('["calc", {}]', "must be a JSON object"),
        ('{"name": "calc", "arguments": {}, "id": 7}', "unexpected keys ['id']"),
        ('{"name": "calc", "name": "other", "arguments": {}}', "duplicate key"),
        ('{"name": "calc", "arguments": {"x": NaN}}', "NaN is not JSON"),
    ],
)
def test_malformed_calls_become_errors(body, needle):
    assert needle in one_error(f"<tool_call>{body}</tool_call>")


def test_unclosed_and_stray_tags():
    assert "unclosed <tool_call>" in one_error('<tool_call>{"name": "a", "arguments": {}}')
    turn = P.parse('<tool_call>{"name": "a"<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert [type(i) for i in turn.items] == [ParseError, ToolCall]
    assert turn.calls[0].name == "b"
    assert "without an opening" in one_error("text </tool_call> more")


def test_input_is_bounded():
    small = HermesParser(max_chars=100, max_call_chars=40, max_calls=2)
    long_turn = "x" * 101
    turn = small.parse(long_turn)
    assert turn.calls == () and "over the tool-call parser's limit of 100" in turn.errors[0].reason
    big_call = '<tool_call>{"name": "a", "arguments": {"s": "' + "y" * 40 + '"}}</tool_call>'
    assert "over the limit of 40" in small.parse(big_call).errors[0].reason
    call = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    turn = HermesParser(max_calls=2).parse(call * 3)
    assert len(turn.calls) == 2
    assert "more than 2 tool calls" in turn.errors[0].reason


def test_deeply_nested_json_is_an_error_not_a_crash():
    body = '{"name": "a", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"
    message = one_error(f"<tool_call>{body}</tool_call>")
    assert "tool call" in message


def test_registry_and_did_you_mean():
    assert isinstance(get_parser("hermes"), HermesParser)
    with pytest.raises(ConfigError, match="did you mean 'hermes'") as exc:
        get_parser("hermse", "stages.rollout.options.parser")
    assert exc.value.path == "stages.rollout.options.parser"

    @register_parser("test-upper")
    class Upper:
        def parse(self, text):
            return HermesParser().parse(
                text.replace("[CALL]", "<tool_call>").replace("[/CALL]", "</tool_call>")
            )

    turn = get_parser("test-upper").parse('[CALL]{"name": "a", "arguments": {}}[/CALL]')
    assert turn.calls == (ToolCall("a", {}),)

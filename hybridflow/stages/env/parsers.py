"""Tool-call parsers: one model turn's text -> the tool calls in it, plus what was wrong.

    parser = get_parser("hermes")          # the `parser:` setting; a registry, did-you-mean
    turn = parser.parse(text)              # ParsedTurn(content, calls, errors)

`hermes` reads the format of Hermes / Qwen2.5 / Qwen3 chat templates:

    Let me compute that.
    <tool_call>
    {"name": "calc", "arguments": {"expression": "3*4"}}
    </tool_call>

Several calls per turn are allowed, in order. `arguments` may also be a JSON string that
holds an object (some models emit it so). Everything outside the tags is `content`.

Strict by design: a call is accepted only when its body is one JSON object with exactly
the keys `name` (a string naming a function: letters, digits, `_`, `-`, `.`, at most 64
characters) and `arguments` (an object, or a string holding one); no duplicate keys, no
NaN/Infinity. Anything else (bad JSON, a missing name, a list, an unclosed tag, a stray
closing tag, a call past `max_calls`) becomes a `ParseError` the environment shows the
model, never an exception. Input is bounded: a turn longer than `max_chars` is refused
whole (one error, no calls), a call body longer than `max_call_chars` is refused alone,
so parsing cost is linear in a bounded input.

Other formats plug in with `@register_parser("name")` on a class with `parse(text)`.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from hybridflow.errors import ConfigError

__all__ = [
    "PARSERS",
    "HermesParser",
    "ParseError",
    "ParsedTurn",
    "ToolCall",
    "ToolCallParser",
    "get_parser",
    "register_parser",
]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")
_SNIPPET = 80  # characters of an offending call quoted back to the model


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParseError:
    """One rejected call: `reason` says what is wrong (shown to the model), `snippet` is
    the start of the offending text."""

    reason: str
    snippet: str = ""

    def message(self) -> str:
        return f"{self.reason}: {self.snippet}" if self.snippet else self.reason


@dataclass(frozen=True)
class ParsedTurn:
    """`items`: the turn's calls and rejected calls in the order they appear (the order
    their results are shown in); `calls` / `errors` are the two kinds alone."""

    content: str  # the turn's text outside the tool-call tags, stripped
    items: tuple[ToolCall | ParseError, ...] = ()

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        return tuple(i for i in self.items if isinstance(i, ToolCall))

    @property
    def errors(self) -> tuple[ParseError, ...]:
        return tuple(i for i in self.items if isinstance(i, ParseError))

    @property
    def attempted(self) -> bool:
        """Whether the model tried to call a tool at all (a valid or a rejected call)."""
        return bool(self.items)


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


PARSERS: dict[str, Callable[..., ToolCallParser]] = {}


def register_parser(name: str) -> Callable[[type], type]:
    """Class decorator: make a parser known to `get_parser(name)` (and `parser: name`)."""

    def deco(cls: type) -> type:
        PARSERS[name] = cls
        return cls

    return deco


def get_parser(name: str, path: str = "parser", **options: Any) -> ToolCallParser:
    """The parser registered as `name`, built with `options`; ConfigError at `path` (with
    the closest known name) when there is none."""
    factory = PARSERS.get(name)
    if factory is None:
        close = difflib.get_close_matches(str(name), list(PARSERS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            path, f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}{hint}"
        )
    return factory(**options)


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _SNIPPET else text[: _SNIPPET - 3] + "..."


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)


def parse_call_body(body: str) -> ToolCall | ParseError:
    """One call's JSON text -> a ToolCall, or the ParseError saying why not."""
    try:
        obj = _loads(body)
    except (ValueError, RecursionError) as exc:
        why = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        return ParseError(f"tool call is not valid JSON ({why})", _snippet(body))
    if not isinstance(obj, dict):
        return ParseError(
            f'tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, '
            f"got a {type(obj).__name__}",
            _snippet(body),
        )
    if "name" not in obj:
        return ParseError('tool call has no "name"', _snippet(body))
    name = obj["name"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return ParseError(f"tool call name must be a function name, got {_snippet(repr(name))}")
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return ParseError(
            f'tool call {name}: unexpected keys {extra} (only "name" and "arguments")'
        )
    if "arguments" not in obj:
        return ParseError(f'tool call {name}: no "arguments" (use {{}} for none)')
    args = obj["arguments"]
    if isinstance(args, str):
        try:
            args = _loads(args)
        except (ValueError, RecursionError):
            return ParseError(
                f"tool call {name}: arguments is a string that is not a JSON object",
                _snippet(obj["arguments"]),
            )
    if not isinstance(args, dict):
        return ParseError(
            f"tool call {name}: arguments must be a JSON object, got {type(args).__name__}"
        )
    return ToolCall(name=name, arguments=args)


@register_parser("hermes")
class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3)."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(
        self, *, max_chars: int = 32_768, max_call_chars: int = 8_192, max_calls: int = 8
    ) -> None:
        if min(max_chars, max_call_chars, max_calls) < 1:
            raise ValueError("HermesParser limits must be >= 1")
        self.max_chars, self.max_call_chars, self.max_calls = max_chars, max_call_chars, max_calls

    def parse(self, text: str) -> ParsedTurn:
        if len(text) > self.max_chars:
            err = ParseError(
                f"turn of {len(text)} characters is over the tool-call parser's limit of "
                f"{self.max_chars}; no call was read"
            )
            return ParsedTurn(content="", items=(err,))
        items: list[ToolCall | ParseError] = []
        content: list[str] = []
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            if start < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:start])
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            nested = text.find(self.open_tag, body_start)
            if end < 0 or 0 <= nested < end:
                stop = len(text) if end < 0 else nested
                snippet = _snippet(text[body_start:stop])
                items.append(ParseError(f"unclosed {self.open_tag}", snippet))
                pos = stop
                continue
            body = text[body_start:end]
            pos = end + len(self.close_tag)
            if len(items) >= self.max_calls:
                items.append(ParseError(f"more than {self.max_calls} tool calls in one turn"))
            elif len(body) > self.max_call_chars:
                items.append(
                    ParseError(
                        f"tool call of {len(body)} characters is over the limit of "
                        f"{self.max_call_chars}"
                    )
                )
            else:
                items.append(parse_call_body(body))
        rest = "".join(content)
        if self.close_tag in rest:
            items.append(ParseError(f"{self.close_tag} without an opening {self.open_tag}"))
            rest = rest.replace(self.close_tag, "")
        return ParsedTurn(content=rest.strip(), items=tuple(items))

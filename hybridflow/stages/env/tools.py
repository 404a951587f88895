"""Tools: plain Python functions, their OpenAI schemas, and one bounded, never-raising call.

    def calc(expression: str) -> str:
        '''Evaluate an arithmetic expression.

        Args:
            expression: numbers, + - * / and parentheses, e.g. "(3 + 4) * 2"
        '''

    tool = Tool.from_function(calc)     # schema from the type hints and the docstring
    tool.schema                         # {"type": "function", "function": {"name": ...}}
    outcome = await tool.invoke({"expression": "3*4"}, timeout_s=5)   # ToolOutcome

The schema is transformers' `get_json_schema` (the same derivation the chat templates'
`tools=` documentation uses), so a function needs a type hint on every parameter and a
Google-style docstring with an `Args:` entry for each; a function that lacks them is a
ConfigError when the tool is built, not a surprise mid-run. transformers' extra `return`
entry is dropped: OpenAI's function schema has none.

`invoke` is the one place a tool runs. It never raises for anything the model did or
the tool did: arguments that do not fit the schema (a missing or unknown parameter, a
wrong JSON type), a tool that raises and a tool past its deadline each give a
ToolOutcome with `error` set (an ErrorKind) and `content` the message the model will
see. A sync tool runs in a daemon thread (protocol.call), an `async def` tool on the
event loop; both are bounded by `timeout_s`. The one exception: EnvStuckError, when so
many of the tool's calls timed out and still run that it is broken (protocol.call's
`max_stuck`), stops the run instead of becoming one more observation. A result that is not a string is shown as
JSON (or str()), cut to `max_chars`.
"""

from __future__ import annotations

import enum
import functools
import inspect
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridflow.errors import ConfigError, EnvStuckError
from hybridflow.stages.env.protocol import EnvTimeout, call

__all__ = ["ErrorKind", "Tool", "ToolOutcome", "check_arguments", "render_result"]

log = logging.getLogger("hybridflow.env.tools")

TRUNCATED = "...(truncated)"
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


class ErrorKind(enum.Enum):
    """Why a tool call did not produce a result (each is counted in `tool_errors`)."""

    PARSE = "parse"  # the call itself was malformed (parsers.ParseError)
    UNKNOWN_TOOL = "unknown_tool"
    BAD_ARGUMENTS = "bad_arguments"
    RAISED = "raised"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class ToolOutcome:
    """One call's result as the model will read it: `content`, and `error` when it failed."""

    name: str
    content: str
    error: ErrorKind | None = None
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def derive_schema(fn: Callable[..., Any], path: str = "tools") -> dict[str, Any]:
    """The OpenAI function schema of `fn` (transformers' get_json_schema, minus `return`).
    ConfigError at `path` when a parameter has no type hint or the docstring no entry."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # transformers' TypeHintParsingException / DocstringParsingException
        raise ConfigError(
            path,
            f"cannot derive a tool schema for {getattr(fn, '__name__', fn)!r}: {exc} "
            "(a tool needs a type hint on every parameter and a docstring with an "
            "`Args:` line for each)",
        ) from exc
    schema["function"].pop("return", None)
    return schema


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any] = field(repr=False)

    @classmethod
    def from_function(cls, fn: Callable[..., Any], path: str = "tools") -> Tool:
        schema = derive_schema(fn, path)
        return cls(name=schema["function"]["name"], fn=fn, schema=schema)

    @property
    def parameters(self) -> dict[str, Any]:
        params: dict[str, Any] = self.schema["function"].get("parameters", {})
        return params

    async def invoke(
        self, arguments: Mapping[str, Any], *, timeout_s: float, max_chars: int = 4096
    ) -> ToolOutcome:
        """Run the tool on `arguments` (a parsed call's object). Never raises."""
        bad = check_arguments(self.parameters, arguments, self._takes_kwargs())
        if bad:
            return ToolOutcome(self.name, f"Error: {self.name}: {bad}", ErrorKind.BAD_ARGUMENTS)
        t0 = time.perf_counter()
        try:
            value = await call(
                functools.partial(self.fn, **arguments),
                timeout_s=timeout_s,
                what=f"tool {self.name}",
                setting="tool_timeout_s",
            )
        except EnvStuckError:
            raise  # too many of its calls still hang: the tool is broken, not the model
        except EnvTimeout:
            return ToolOutcome(
                self.name,
                f"Error: {self.name} timed out after {timeout_s:g} s",
                ErrorKind.TIMEOUT,
                time.perf_counter() - t0,
            )
        except Exception as exc:  # the tool's own failure: the model reads it, the run goes on
            log.debug("tool %s raised %s: %s", self.name, type(exc).__name__, exc)
            return ToolOutcome(
                self.name,
                f"Error: {self.name} failed: {type(exc).__name__}: {exc}"[:max_chars],
                ErrorKind.RAISED,
                time.perf_counter() - t0,
            )
        return ToolOutcome(
            self.name, render_result(value, max_chars), None, time.perf_counter() - t0
        )

    def _takes_kwargs(self) -> bool:
        try:
            params = inspect.signature(self.fn).parameters.values()
        except (TypeError, ValueError):
            return False
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def check_arguments(
    parameters: Mapping[str, Any], arguments: Mapping[str, Any], open_ended: bool = False
) -> str:
    """Why `arguments` do not fit a JSON-schema `parameters` object ("" when they do):
    a required parameter missing, an unknown one (unless `open_ended`), or a top-level
    value of the wrong JSON type / outside its `enum`."""
    props: Mapping[str, Any] = parameters.get("properties", {})
    missing = [p for p in parameters.get("required", []) if p not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    unknown = sorted(set(arguments) - set(props))
    if unknown and not open_ended:
        return f"unknown argument(s) {unknown}; parameters are {sorted(props)}"
    for key, value in arguments.items():
        spec = props.get(key)
        if not spec:
            continue
        why = _type_mismatch(spec, value)
        if why:
            return f"argument {key!r} {why}"
    return ""


def _type_mismatch(spec: Mapping[str, Any], value: Any) -> str:
    if value is None and spec.get("nullable"):
        return ""
    kinds = spec.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        ok = False
        for kind in kinds:
            types = _JSON_TYPES.get(kind)
            if types is None:  # a JSON-schema type we do not check: accept
                ok = True
                break
            # bool is an int in Python, never a JSON integer or number
            if isinstance(value, types) and not (isinstance(value, bool) and kind != "boolean"):
                ok = True
                break
        if not ok:
            return f"must be {' or '.join(kinds)}, got {_json_type(value)}"
    if "enum" in spec and value not in spec["enum"]:
        return f"must be one of {spec['enum']}, got {value!r}"
    return ""


def _json_type(value: Any) -> str:
    for name, types in _JSON_TYPES.items():
        if isinstance(value, types) and not (isinstance(value, bool) and name != "boolean"):
            return name
    return type(value).__name__


def render_result(value: Any, max_chars: int) -> str:
    """A tool's return value as the text the model reads: strings as they are, other
    values as JSON (str() when not JSON-able); cut to `max_chars` with a marker."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):
            text = str(value)
    if len(text) > max_chars:
        keep = max(0, max_chars - len(TRUNCATED))
        text = text[:keep] + TRUNCATED
    return text

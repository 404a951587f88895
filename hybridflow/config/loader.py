"""Strict, typed config loading: YAML/dict -> frozen dataclasses, errors with dotted paths.

Each component owns a small dataclass `Config` next to it; this module turns plain data
into those dataclasses and refuses anything it does not understand:

  - unknown keys       -> ConfigError("stages.reward.replcas", "unknown key; did you mean 'replicas'?")
  - wrong types        -> ConfigError("run.steps", "expected int, got str 'three'")
  - value constraints  -> a dataclass's `validate(self, path)` hook raises ConfigError itself

Supported field types: bool/int/float/str, Literal[...], Enum, Optional/unions of those,
list[T], tuple[T, ...], dict[str, T], nested dataclasses, and `Any` (kept as is; used for
backend-specific `options`). `--set a.b=c` overrides are parsed as YAML scalars; a
numeric part indexes a list (`dataflow.3.params.kl_coef=0.1`; `dataflow[3].params.kl_coef`,
the form error messages print, means the same).

YAML is read by `parse_yaml`, which refuses what `yaml.safe_load` lets through:
  - duplicate keys     -> ConfigError("run.steps", "duplicate key in f.yaml: line 3 and line 9")
  - alias bombs        -> a document whose aliases expand to more than MAX_YAML_NODES nodes
                          (or refer to themselves) is refused before anything walks it
  - nesting deeper than the parser's recursion -> ConfigError naming the file
Numbers: a `float` field takes finite numbers only (`.nan`, `.inf` name their key).
YAML reads numbers as YAML 1.2 and JSON do: `1e-9`, `3E5` and `1.0e5` are floats (PyYAML's
YAML 1.1 rules, which need a dot and a signed exponent, would read them as strings), in a
file, in `--set` values and in options of any type. A string stays a string: a quoted
number (`lr: "1e-5"`) in a numeric field is an error saying so (remove the quotes), never
converted silently; a string field given an unquoted number is an error too (quote it).

Invariant: a successfully loaded config is fully typed and validated; nothing downstream
re-checks types.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import hashlib
import json
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from hybridflow.errors import ConfigError

T = TypeVar("T")


class _Loader(yaml.SafeLoader):
    """`yaml.SafeLoader` with YAML 1.2's floats: a number with an exponent needs no dot
    and no exponent sign (`1e-9`, `5E3`, `.5e1`). add_implicit_resolver copies the
    resolver table for this class, so yaml.SafeLoader itself is left as it is."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9][0-9_]*(?:\.[0-9_]*)?)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)
# A string that a numeric field would have taken as a number without its quotes.
_NUMBER = re.compile(r"^\s*[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?\s*$")

# A topology is a few hundred nodes; aliases may share subtrees, but a document that
# would expand to more than this is an alias bomb (or a mistake), never a config.
MAX_YAML_NODES = 100_000


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError("", f"config file {str(p)!r} does not exist")
    data = parse_yaml(p.read_text(), str(p))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", f"{p}: top level must be a mapping, got {type(data).__name__}")
    return data


def parse_yaml(text: str, where: str) -> Any:
    """`yaml.safe_load(text)` (tags never construct objects), with the checks of the
    module docstring run on the composed node graph before anything is constructed.
    `where` names the source (a file, `--set key`) in errors."""
    loader = _Loader(text)
    try:
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_nodes(node, where)
            return loader.construct_document(node)
        except yaml.YAMLError as exc:
            raise ConfigError("", f"{where}: not valid YAML: {exc}") from exc
        except RecursionError:
            raise ConfigError("", f"{where}: nested too deeply to be a config") from None
    finally:
        loader.dispose()


def _check_nodes(root: yaml.Node, where: str) -> None:
    """Duplicate keys (named by dotted path and both lines) and the expanded size.

    Each node is visited once (an alias is the same node object as its anchor), so this
    is linear in the document's text; `expanded` counts what a walk of the constructed
    data would visit: a node reached through k aliases counts k times."""
    expanded: dict[int, int] = {}
    visiting: set[int] = set()

    def size(node: yaml.Node, path: str) -> int:
        key = id(node)
        if key in expanded:
            return expanded[key]
        if key in visiting:
            raise ConfigError(path, f"{where}: an alias refers to a node that contains it")
        visiting.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for k, v in node.value:
                name = k.value if isinstance(k, yaml.ScalarNode) else None
                sub = f"{path}.{name}" if path else str(name)
                if name is not None and name != "<<":  # `<<` merge keys may repeat
                    line = k.start_mark.line + 1
                    if name in seen:
                        raise ConfigError(
                            sub,
                            f"duplicate key in {where}: line {seen[name]} and line {line}; "
                            "a mapping takes each key once",
                        )
                    seen[name] = line
                total += size(k, sub) + size(v, sub)
                if total > MAX_YAML_NODES:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                total += size(v, f"{path}[{i}]")
                if total > MAX_YAML_NODES:
                    break
        visiting.discard(key)
        if total > MAX_YAML_NODES:
            raise ConfigError(
                path,
                f"{where}: expands to more than {MAX_YAML_NODES} nodes through YAML aliases "
                "(an alias bomb?); write the values out",
            )
        expanded[key] = total
        return total

    size(root, "")


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` strings (value parsed as a YAML scalar/flow) to a nested dict."""
    out: dict[str, Any] = _deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(key or item, "override must look like KEY=VALUE, e.g. run.steps=3")
        try:
            value = parse_yaml(raw, f"--set {key}") if raw.strip() else ""
        except ConfigError as exc:
            raise ConfigError(key, f"override value {raw!r} refused: {exc}") from exc
        node: Any = out
        parts = re.sub(r"\[(\d+)\]", r".\1", key).split(".")  # a[3].b -> a.3.b
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):  # a list item by index: dataflow.3.params.kl_coef=0.1
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(
                        ".".join(parts[: i + 1]),
                        f"{part!r} is not an index of this list (0..{len(node) - 1})",
                    )
                if last:
                    node[int(part)] = value
                    break
                nxt = node[int(part)]
            else:
                if last:
                    node[part] = value
                    break
                nxt = node.get(part)
                if nxt is None:
                    nxt = node[part] = {}
            if not isinstance(nxt, (dict, list)):
                raise ConfigError(
                    ".".join(parts[: i + 1]), "is not a mapping; cannot set a sub-key"
                )
            node = nxt
    return out


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass `cls` from plain data, strictly. Raises ConfigError with dotted paths."""
    result: T = _convert(cls, data, path)
    return result


def to_dict(obj: Any) -> Any:
    """Plain-data form of a config (inverse of `from_dict`), for YAML/JSON and hashing."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def config_hash(obj: Any) -> str:
    """Stable short hash of a config; stages check it at the handshake."""
    blob = json.dumps(to_dict(obj), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# ---------------------------------------------------------------------------------------


def _describe(v: Any) -> str:
    text = repr(v)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(v).__name__} {text}"


def _quoted_number(value: Any) -> str:
    """The hint for a numeric field given a string that looks like a number."""
    if isinstance(value, str) and _NUMBER.match(value):
        return f": a quoted number; write it without quotes ({value.strip()})"
    return ""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp)


def _convert(tp: Any, value: Any, path: str) -> Any:
    """`value` as type `tp` (the field types of the module docstring), or ConfigError."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _convert_union(tp, value, path)
    if origin is typing.Literal:
        args = typing.get_args(tp)
        if value in args and not (isinstance(value, bool) and not any(a is value for a in args)):
            return value
        raise ConfigError(path, f"must be one of {', '.join(repr(a) for a in args)}; got {value!r}")
    if origin in (list, Sequence, tuple):
        return _convert_sequence(tp, value, path)
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {_describe(value)}")
        kt, vt = typing.get_args(tp) or (Any, Any)
        out = {}
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            out[_convert(kt, k, sub)] = _convert(vt, v, sub)
        return out
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in tp)
            raise ConfigError(path, f"must be one of {choices}; got {value!r}") from None
    if tp in (bool, int, float, str):
        return _convert_scalar(tp, value, path)
    raise TypeError(f"config loader: unsupported field type {tp!r} at {path}")


def _convert_union(tp: Any, value: Any, path: str) -> Any:
    """The first member of the union that takes `value`; its error if it is the only one."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(arg, value, path)
        except ConfigError as exc:
            errors.append(exc)
    if len(errors) == 1:
        raise errors[0]
    raise ConfigError(path, f"expected {_type_name(tp)}, got {_describe(value)}")


def _convert_sequence(tp: Any, value: Any, path: str) -> Any:
    """list[T] / Sequence[T] -> a list; tuple[T, ...] and fixed tuples -> a tuple."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if not isinstance(value, (list, tuple)):
        raise ConfigError(path, f"expected a list, got {_describe(value)}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(path, f"expected {len(args)} items, got {len(value)}")
        return tuple(
            _convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    item = args[0] if args else Any
    items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _convert_scalar(tp: type, value: Any, path: str) -> Any:
    """bool, int, float (finite), str: never converted from another type."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected true/false, got {_describe(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected int, got {_describe(value)}{_quoted_number(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int beyond float range (10**400)
                number = math.inf
            if not math.isfinite(number):
                raise ConfigError(path, f"must be a finite number, got {value!r}")
            return number
        raise ConfigError(path, f"expected a number, got {_describe(value)}{_quoted_number(value)}")
    if isinstance(value, str):
        return value
    raise ConfigError(path, f"expected a string, got {_describe(value)}")


def _convert_dataclass(cls: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(value) and isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping, got {_describe(value)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in value:
        if key not in fields:
            sub = f"{path}.{key}" if path else str(key)
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(fields)}"
            raise ConfigError(sub, f"unknown key; {hint}")
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in value:
            kwargs[name] = _convert(hints[name], value[name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(sub, "is required")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate(path)
    return obj


def _deepcopy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deepcopy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy(v) for v in data]
    return data

"""Strict, typed config loading: YAML/dict -> frozen dataclasses, errors with dotted paths.

Each component owns a small dataclass `Config` next to it; this module turns plain data
into those dataclasses and refuses anything it does not understand:

  - unknown keys       -> ConfigError("stages.reward.replcas", "unknown key; did you mean 'replicas'?")
  - wrong types        -> ConfigError("run.steps", "expected int, got str 'three'")
  - value constraints  -> a dataclass's `validate(self, path)` hook raises ConfigError itself

Supported field types: bool/int/float/str, Literal[...], Enum, Optional/unions of those,
list[T], tuple[T, ...], dict[str, T], nested dataclasses, and `Any` (kept as is; used for
backend-specific `options`). `--set a.b=c` overrides are parsed as YAML scalars; a
numeric part indexes a list (`dataflow.3.params.kl_coef=0.1`).

Invariant: a successfully loaded config is fully typed and validated; nothing downstream
re-checks types.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import hashlib
import json
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from hybridflow.errors import ConfigError

T = TypeVar("T")


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError("", f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text())  # safe_load: YAML tags never construct objects
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{p}: not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", f"{p}: top level must be a mapping, got {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` strings (value parsed as a YAML scalar/flow) to a nested dict."""
    out: dict[str, Any] = _deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(key or item, "override must look like KEY=VALUE, e.g. run.steps=3")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(key, f"override value {raw!r} is not valid YAML: {exc}") from exc
        node: Any = out
        parts = key.split(".")
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
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    if origin in (typing.Union, types.UnionType):
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

    if origin is typing.Literal:
        if value in args and not (isinstance(value, bool) and not any(a is value for a in args)):
            return value
        raise ConfigError(path, f"must be one of {', '.join(repr(a) for a in args)}; got {value!r}")

    if origin in (list, Sequence, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {_describe(value)}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(path, f"expected {len(args)} items, got {len(value)}")
            return tuple(
                _convert(a, v, f"{path}[{i}]")
                for i, (a, v) in enumerate(zip(args, value, strict=True))
            )
        item = args[0] if args else Any
        items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items

    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {_describe(value)}")
        kt, vt = args if args else (Any, Any)
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

    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected true/false, got {_describe(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected int, got {_describe(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(path, f"expected a number, got {_describe(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(path, f"expected a string, got {_describe(value)}")
    raise TypeError(f"config loader: unsupported field type {tp!r} at {path}")


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

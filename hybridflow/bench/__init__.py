"""Benchmarks behind `hybridflow bench WHAT --json`; each module exposes run(args) -> dict.

Every bench has a `--quick` mode that takes the same code paths as the full run at small
sizes (the smoke tests in `make test` run each one that way). A bench with its own
argparse options (native-engine, logprob-gap, train) reads `hybridflow bench ... --set
KEY=VALUE` as those options (`--set seqs=64,128`); one without settings refuses `--set`
rather than ignore it.
"""

from __future__ import annotations

import argparse
from typing import Any

from hybridflow.errors import ConfigError

__all__ = ["refuse_sets", "with_options"]


def with_options(args: argparse.Namespace, defaults: dict[str, Any], bench: str) -> Any:
    """`args` from `hybridflow bench` (or the module's own parser) completed with the
    bench's `defaults`, then `--set key=value` items applied, each converted to the type
    of its default. An unknown key or a value of the wrong type is a ConfigError."""
    merged = argparse.Namespace(**{**defaults, **vars(args)})
    for item in getattr(args, "overrides", None) or []:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in defaults or key in ("json", "quick"):
            known = ", ".join(sorted(k for k in defaults if k not in ("json", "quick")))
            raise ConfigError(f"bench.{bench}.{key}", f"unknown setting; known: {known}")
        setattr(merged, key, _convert(value.strip(), defaults[key], f"bench.{bench}.{key}"))
    return merged


def refuse_sets(args: argparse.Namespace, bench: str) -> None:
    """For a bench without settings: `--set` is an error, not silently ignored."""
    sets = getattr(args, "overrides", None) or []
    if sets:
        raise ConfigError(f"bench.{bench}", f"takes no --set settings, got {sets[0]!r}")


def _convert(value: str, default: Any, path: str) -> Any:
    if isinstance(default, bool):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(path, f"expected true or false, got {value!r}")
    if isinstance(default, int | float):
        kind = type(default)
        try:
            return kind(value)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise ConfigError(path, f"expected {what}, got {value!r}") from None
    return value  # a string option (or one whose default is None)

"""`"package.module:attr"` strings -> Python objects: the one loader every registry uses.

Backends, data sources, driver ops, metrics sinks, reward functions and CLI commands are
named in config as `"package.module:attr"` (the attribute may be dotted: `mod:Class.fn`).
This module is the only place that turns such a string into an object, so every
registry reports a bad name the same way: a ConfigError whose path is the dotted config
key that held the string, saying whether the module or the attribute is missing.

    split_spec("pkg.mod:fn", "stages.r.roles.reward.options.function") -> ("pkg.mod", "fn")
    load_attr("pkg.mod:fn", "dataflow[3].op")                         -> the object

Invariants: a string is imported with `importlib` and `getattr`, never `eval`'d;
`split_spec` imports nothing (safe at build time, before any process exists); inside
`cwd_off_path()` (what `hybridflow validate` uses) nothing loads from the working
directory unless it is named in PYTHONPATH; inside `cwd_off_path(allow=True)` it does,
after installed packages (a `json.py` there still cannot shadow the real one).

Where the working directory is on `sys.path` at all: the console script (`hybridflow`)
puts its own bin/ first, not the working directory; `python -m hybridflow` would put the
working directory first, and hybridflow/__main__.py takes it off before anything else is
imported, so both entry points see the same path; stage processes run `python -P`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from hybridflow.errors import ConfigError

__all__ = ["cwd_off_path", "load_attr", "split_spec", "stage_import_path"]

# The directory holding hybridflow/: what the launcher puts on a stage process's PYTHONPATH
# (pipeline/runtime/launcher.py), so modules beside the package import there.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


@contextlib.contextmanager
def cwd_off_path(*, allow: bool = False) -> Iterator[None]:
    """While inside, the working directory is off `sys.path` (the implicit entry that
    `python -m`, `-c` and a REPL put first: a `json.py` there would shadow the real one),
    unless PYTHONPATH names it. What `python -P` does for a whole process.

    With `allow`, the opposite: the working directory is importable while inside, last on
    the path (after installed packages), whatever entry point started the process (the
    console script never puts it there)."""
    cwd = os.path.realpath(os.getcwd())
    if allow:
        with _last_on_path(cwd):
            yield
        return
    named = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    saved = list(sys.path)
    sys.path[:] = [
        p for p in saved if os.path.realpath(p or ".") != cwd or os.path.realpath(p) in named
    ]
    try:
        yield
    finally:
        sys.path[:] = saved


@contextlib.contextmanager
def stage_import_path() -> Iterator[None]:
    """While inside, `sys.path` also holds what a stage process's path holds and this
    process's may not (the directory holding hybridflow/, last): a module a stage will
    import is checked here as the stage will find it."""
    with _last_on_path(PACKAGE_ROOT):
        yield


@contextlib.contextmanager
def _last_on_path(directory: str) -> Iterator[None]:
    """While inside, `directory` is on `sys.path` (appended, so it shadows nothing) unless
    it already was; removed again at the end only if it was added here."""
    added = directory not in {os.path.realpath(p or ".") for p in sys.path}
    if added:
        sys.path.append(directory)
    try:
        yield
    finally:
        if added and directory in sys.path:
            sys.path.remove(directory)


def split_spec(spec: object, path: str, *, form: str = "package.module:attr") -> tuple[str, str]:
    """`"package.module:attr[.attr]"` -> (module, attr), checking the syntax only.

    Raises ConfigError at `path` unless `spec` is a string with a non-empty module and
    attribute on either side of exactly one colon; the message shows `form` (what the
    key expects, e.g. "package.module:function")."""
    if isinstance(spec, str):
        module, sep, attr = spec.partition(":")
        if sep and module.strip() and attr.strip() and ":" not in attr:
            return module.strip(), attr.strip()
    raise ConfigError(path, f"must look like '{form}', got {spec!r}")


def load_attr(
    spec: object, path: str, *, callable_only: bool = False, form: str = "package.module:attr"
) -> Any:
    """Import `"package.module:attr[.attr]"` and return the attribute.

    Raises ConfigError at `path` (the dotted key that named it) when the string is
    malformed, the module cannot be imported, an attribute is missing, or, with
    `callable_only`, the object is not callable. An ImportError raised *inside* the
    target module is reported with its own message, so a broken dependency is not
    mistaken for a typo."""
    module_name, attr = split_spec(spec, path, form=form)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(path, f"cannot import module {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(
                path, f"module {module_name!r} has no attribute {attr!r} ({spec!r})"
            ) from None
    if callable_only and not callable(obj):
        raise ConfigError(path, f"{spec!r} is a {type(obj).__name__}, not callable")
    return obj

"""The Python API reference, from signatures and docstrings (inspect), nothing hand-copied.

Covers the programming model (`DataflowBuilder`, `Engine`, `TrainResult`), the reward
service SDK, the extension registries and seams a new backend, driver op, data source or
sink plugs into, and the environment protocol. `API` lists them; everything public that
an object defines itself is shown, in source order.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from typing import Any

from docgen.markdown import prose

# (section title, intro, [dotted names]): the public surface the reference covers.
API: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "Programming model",
        "`from hybridflow import DataflowBuilder` (the `Engine` comes from `df.build()`).",
        (
            "hybridflow.pipeline.api.builder",
            "hybridflow.DataflowBuilder",
            "hybridflow.pipeline.api.engine",
            "hybridflow.Engine",
            "hybridflow.pipeline.api.engine.TrainResult",
        ),
    ),
    (
        "Configuration",
        "Topologies from Python: the same loader `hybridflow run` uses.",
        ("hybridflow.config.load_topology", "hybridflow.pipeline.run_topology"),
    ),
    (
        "Reward services",
        "Serve a Python function as a reward service ([protocol](../reward-service.md)).",
        ("hybridflow.reward.serve", "hybridflow.reward.start_server"),
    ),
    (
        "Extension points",
        "See [Extending](../extending.md) for how they fit together.",
        (
            "hybridflow.stages.contract.op",
            "hybridflow.stages.contract.Scope",
            "hybridflow.stages.contract.RoleBase",
            "hybridflow.stages.base.StageContext",
            "hybridflow.stages.base.register",
            "hybridflow.pipeline.driver.registry",
            "hybridflow.pipeline.driver.registry.register_driver_op",
            "hybridflow.pipeline.driver.registry.reads_params",
            "hybridflow.pipeline.sources.registry",
            "hybridflow.pipeline.sources.registry.DataSource",
            "hybridflow.pipeline.sources.registry.register_source",
            "hybridflow.pipeline.observe.metrics",
            "hybridflow.pipeline.observe.metrics.MetricsSink",
            "hybridflow.pipeline.observe.metrics.register_sink",
        ),
    ),
    (
        "Environments",
        "Multi-turn environments ([tutorial](../tutorials/multi-turn.md)).",
        (
            "hybridflow.stages.env.protocol",
            "hybridflow.stages.env.Environment",
            "hybridflow.stages.env.ToolEnv",
        ),
    ),
)


def resolve(dotted: str) -> Any:
    """A module, or an attribute of the longest importable module prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def doc_markdown(doc: str) -> str:
    """A docstring as Markdown: indented blocks stay code, prose is escaped."""
    out = []
    for line in inspect.cleandoc(doc).splitlines():
        out.append(line if line.startswith("    ") or not line.strip() else prose(line))
    return "\n".join(_separate_code(out))


def _separate_code(lines: list[str]) -> Iterator[str]:
    """A blank line before and after every indented block, so Markdown sees code."""
    prev_code = False
    prev_blank = True
    for line in lines:
        is_code = line.startswith("    ")
        blank = not line.strip()
        if not blank and is_code != prev_code and not prev_blank:
            yield ""
        yield line
        if not blank:
            prev_code = is_code
        prev_blank = blank


class _Written:
    """An annotation shown as written (a string annotation would print quoted)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _plain(annotation: Any) -> Any:
    return _Written(annotation) if isinstance(annotation, str) else annotation


def _signature(name: str, obj: Any) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    sig = sig.replace(
        parameters=[p.replace(annotation=_plain(p.annotation)) for p in sig.parameters.values()],
        return_annotation=_plain(sig.return_annotation),
    )
    prefix = "async def " if inspect.iscoroutinefunction(obj) else ""
    return f"{prefix}{name}{sig}"


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    for name, value in vars(cls).items():
        if name.startswith("_") and name not in ("__init__", "__enter__"):
            continue
        if name == "__enter__":
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if inspect.isfunction(value) or isinstance(value, property):
            yield name, value


def render_object(dotted: str) -> list[str]:
    obj = resolve(dotted)
    short = dotted.rsplit(".", 1)[-1]
    if inspect.ismodule(obj):
        return [f"### Module `{dotted}`", "", doc_markdown(obj.__doc__ or ""), ""]
    out = [f"### `{dotted}`", ""]
    if inspect.isclass(obj):
        kind = "class"
        out += ["```python", f"{kind} {_signature(short, obj)}", "```", ""]
        out += [doc_markdown(inspect.getdoc(obj) or ""), ""]
        for name, member in _members(obj):
            if name == "__init__":
                continue
            if isinstance(member, property):
                out += [f"#### `{short}.{name}` (property)", ""]
                out += [doc_markdown(member.__doc__ or ""), ""]
                continue
            out += [f"#### `{short}.{name}`", "", "```python"]
            out += [_signature(name, member).replace("(self, ", "(").replace("(self)", "()")]
            out += ["```", "", doc_markdown(inspect.getdoc(member) or ""), ""]
        return out
    out += ["```python", _signature(short, obj), "```", ""]
    out += [doc_markdown(inspect.getdoc(obj) or ""), ""]
    return out


def undocumented() -> list[str]:
    """Public callables of the reference without a docstring."""
    missing = []
    for _, _, names in API:
        for dotted in names:
            obj = resolve(dotted)
            if not (obj.__doc__ or "").strip():
                missing.append(dotted)
            if inspect.isclass(obj):
                for name, member in _members(obj):
                    if name != "__init__" and not (member.__doc__ or "").strip():
                        missing.append(f"{dotted}.{name}")
    return missing


def render_api() -> str:
    out = [
        "# Python API reference",
        "",
        "Generated from the signatures and docstrings of the code by `scripts/docgen`.",
        "",
    ]
    for title, intro, names in API:
        out += [f"## {title}", "", intro, ""]
        for dotted in names:
            out += render_object(dotted)
    return "\n".join(out)

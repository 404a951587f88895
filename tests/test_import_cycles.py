"""No two modules of hybridflow import each other in a circle (issue 26's bar: 0 circles).

The graph is read from the source with `ast`, not by importing: one edge per import that
runs when a module is imported (its body, `if TYPE_CHECKING:` blocks, try/with blocks and
class bodies), none for imports inside functions (the deliberate lazy ones). `from P import
x` counts as an import of the module `P.x` when there is one, else of `P`.
import-linter cannot say this: its graph counts imports inside functions too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hybridflow

ROOT = Path(hybridflow.__file__).parent
_BLOCKS = (ast.If, ast.Try, ast.With, ast.ClassDef)


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _import_time_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, _BLOCKS):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    inner = child.body if isinstance(child, ast.ExceptHandler) else [child]
                    found += _import_time_imports(inner)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the hybridflow modules it imports at import time."""
    modules = _modules()

    def known(name: str) -> str | None:  # the deepest module that `name` names
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in _import_time_imports(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base)
                    for a in node.names
                ]
            deps.update(t for t in targets if t is not None and t != mod)
        graph[mod] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_hybridflow_has_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_check_sees_circles() -> None:
    graph = import_graph()
    assert "hybridflow.transport.liveness" in graph["hybridflow.transport.channel.endpoint"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None

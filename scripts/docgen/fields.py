"""Field docs of option dataclasses, read from their source (nothing is imported twice).

A field's doc is, first found wins:
  1. an attribute docstring: a string literal right after the field (PEP 257's form);
  2. its comments: the comment lines directly above it (no blank line between) and the
     comment at the end of its line, joined;
  3. a line `name: value  # doc` (with `#` continuation lines) in the docstring of the
     module that declares the class, for modules that document options as a YAML example.
Type and default come from `dataclasses.fields` (types as written: every config module
uses `from __future__ import annotations`), with a name of a `Literal` alias (the one
table of a set of values, e.g. `LossAggMode` in hybridflow.algos.losses) written out as
its values, so the reference shows what a key takes.

Invariant: `field_docs(cls)` lists every field of `cls` in `dataclasses.fields` order,
each with the class that declares it, so a field without a doc is visible (doc == "").
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import typing
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FieldDoc:
    name: str
    type: str  # the annotation as written
    default: str  # "" when the field is required
    doc: str
    owner: type  # the class whose body declares the field

    @property
    def required(self) -> bool:
        return self.default == ""


@functools.cache
def _own_docs(cls: type) -> dict[str, str]:
    """Docs of the fields declared in `cls`'s own body."""
    lines, _ = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    comments: dict[int, str] = {}  # line -> comment text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.add(tok.start[0])
    tree = ast.parse(source)
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        after = body[i + 1] if i + 1 < len(body) else None
        if (
            isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        end = node.end_lineno or node.lineno
        trailing = [comments[n] for n in range(node.lineno, end + 1) if n in comments]
        docs[node.target.id] = " ".join([*above, *trailing]).strip()
    return docs


_ENTRY = re.compile(r"^\s*([A-Za-z_]\w*):[^#]*#\s?(.*)$")
_MORE = re.compile(r"^\s+#\s?(.*)$")


@functools.cache
def _module_entries(module: str) -> dict[str, str]:
    """`name: value  # doc` lines of a module's docstring -> {name: doc}."""
    doc = getattr(sys.modules.get(module), "__doc__", None) or ""
    entries: dict[str, str] = {}
    current = ""
    for line in doc.splitlines():
        more = _MORE.match(line)
        if current and more:
            entries[current] += " " + more.group(1).strip()
            continue
        match = _ENTRY.match(line)
        current = match.group(1) if match else ""
        if match:
            entries[current] = match.group(2).strip()
    return entries


def _doc(owner: type, name: str) -> str:
    return _own_docs(owner).get(name, "") or _module_entries(owner.__module__).get(name, "")


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return f"{type(value).__name__}()"
        return repr(value)
    return ""


def declaring_class(cls: type, name: str) -> type:
    """The class in `cls`'s MRO whose own body annotates field `name`."""
    for klass in cls.__mro__:
        if name in inspect.get_annotations(klass):
            return klass
    return cls


_NAME = re.compile(r"\b[A-Za-z_]\w*\b")


def _written_type(owner: type, annotation: Any) -> str:
    """The annotation as written, with every Literal alias it names expanded."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    text = text or str(annotation)
    scope = vars(sys.modules[owner.__module__])

    def expand(match: re.Match[str]) -> str:
        value = scope.get(match.group(0))
        if typing.get_origin(value) is not typing.Literal:
            return match.group(0)
        return "Literal[" + ", ".join(json.dumps(v) for v in typing.get_args(value)) + "]"

    return _NAME.sub(expand, text)


def field_docs(cls: type) -> list[FieldDoc]:
    """Every field of dataclass `cls`, with its type, default, doc and declaring class."""
    out = []
    for f in dataclasses.fields(cls):
        owner = declaring_class(cls, f.name)
        out.append(
            FieldDoc(
                name=f.name,
                type=_written_type(owner, f.type),
                default=_default(f),
                doc=_doc(owner, f.name),
                owner=owner,
            )
        )
    return out


def class_doc(cls: type) -> str:
    """`cls`'s own docstring; "" for none (dataclasses make one of the signature)."""
    doc = cls.__dict__.get("__doc__") or ""
    if dataclasses.is_dataclass(cls) and doc.startswith(f"{cls.__name__}("):
        return ""
    return inspect.cleandoc(doc)

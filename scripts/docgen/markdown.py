"""Small Markdown helpers shared by the generators (tables, code spans, paragraphs).

Python-Markdown's tables do not split a row on a pipe inside a code span, so only the
pipes outside code spans are escaped.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def prose(text: str) -> str:
    """Text on one line, with `<`, `>` and `&` outside code spans made literal."""
    text = " ".join(text.split())
    parts, last = [], 0
    for match in _CODE_SPAN.finditer(text):
        parts.append(_escape(text[last : match.start()]))
        parts.append(match.group(0))
        last = match.end()
    parts.append(_escape(text[last:]))
    return "".join(parts)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def cell(text: str) -> str:
    """Text for one table cell: `prose`, and the pipes outside code spans escaped."""
    text = prose(text)
    parts, last = [], 0
    for match in _CODE_SPAN.finditer(text):
        parts.append(text[last : match.start()].replace("|", "\\|"))
        parts.append(match.group(0))
        last = match.end()
    parts.append(text[last:].replace("|", "\\|"))
    return "".join(parts)


def code(text: object) -> str:
    """An inline code span on one line."""
    text = " ".join(str(text).split())
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def first_paragraph(doc: str) -> str:
    """The first paragraph of a docstring, on one line, as `prose`."""
    return prose(doc.strip().split("\n\n", 1)[0])

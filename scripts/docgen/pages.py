"""The generated pages of the docs site, and the checks that keep the docs honest.

`generate()` -> {page path under docs/: Markdown}. The mkdocs hook (mkdocs_hook.py) adds
these pages to every build, so they are never stored and cannot drift; `scripts/gen_docs.py
--out DIR` writes them to a directory to read them without mkdocs.
`problems()` lists what must fail a strict build: an option field without a doc (outside
`config_ref.PENDING`), or a PENDING entry that has meanwhile been documented.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from docgen import api_ref, cli_ref, config_ref, logic_ref

REPO = Path(__file__).resolve().parents[2]


def _results() -> str:
    text = (REPO / "bench" / "RESULTS.md").read_text()
    note = (
        "\n\n!!! note\n    This page is `bench/RESULTS.md`, copied at build time: every number"
        " measured on the project's machines lives there and only there.\n"
    )
    head, sep, rest = text.partition("\n")
    return head + note + sep + rest


PAGES: dict[str, Callable[[], str]] = {
    "reference/config.md": config_ref.render_config,
    "reference/options.md": config_ref.render_options,
    "reference/step-logic.md": logic_ref.render_logic,
    "reference/python-api.md": api_ref.render_api,
    "reference/cli.md": cli_ref.render_cli,
    "results.md": _results,
}


def generate() -> dict[str, str]:
    return {path: render() for path, render in PAGES.items()}


def problems() -> list[str]:
    missing = config_ref.undocumented()
    out = [
        f"option {name} has no doc: add a comment on its line (or above it) in "
        f"{config_ref.PENDING.get(name, 'its dataclass')}"
        for name in missing
        if name not in config_ref.PENDING
    ]
    out += [
        f"option {name} is documented now: remove it from config_ref.PENDING"
        for name in config_ref.PENDING
        if name not in missing
    ]
    return out

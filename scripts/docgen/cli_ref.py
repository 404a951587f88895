"""The CLI reference: `hybridflow`'s argparse parser, built and walked (hybridflow/cli.py).

Every subcommand, its usage line and each argument's flags, default, choices and help come
from the parser itself, so a new flag or subcommand appears here without an edit.
"""

from __future__ import annotations

import argparse
import os

from docgen.markdown import cell, code, table


def parser() -> argparse.ArgumentParser:
    from hybridflow import cli

    return cli._parser()


def subcommands(p: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """name -> (its parser, its one-line help), in the order the parser declares them."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return {name: (sp, helps.get(name, "")) for name, sp in action.choices.items()}
    return {}


def _flags(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(action.option_strings)
        if action.nargs == 0:
            return code(names)
        metavar = action.metavar or (action.dest.upper() if not action.choices else None)
        if action.choices and not action.metavar:
            metavar = "{" + ",".join(map(str, action.choices)) + "}"
        if action.nargs == "?":
            metavar = f"[{metavar}]"
        return code(f"{names} {metavar}")
    return code(action.metavar or action.dest)


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS, []):
        return ""
    return code(action.default)


def _arguments(p: argparse.ArgumentParser) -> str:
    rows = []
    for action in p._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        help_text = action.help or ""
        if action.choices and action.option_strings == [] and action.metavar is None:
            help_text = (
                (help_text + " " if help_text else "")
                + "one of: "
                + ", ".join(code(c) for c in action.choices)
            )
        if isinstance(action, argparse._AppendAction):
            help_text += " (repeatable)" if "repeatable" not in help_text else ""
        if action.nargs == "?" and action.const is not None and action.option_strings:
            help_text += f" (given alone: {code(action.const)})"
        rows.append([_flags(action), _default(action), cell(help_text)])
    return table(["argument", "default", "meaning"], rows)


def render_cli() -> str:
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "88"  # argparse wraps usage lines to the terminal: fix the width
    try:
        return _render()
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns


def _render() -> str:
    p = parser()
    p.prog = "hybridflow"
    out = [
        "# CLI reference",
        "",
        "Generated from the argparse parser in `hybridflow/cli.py` by `scripts/docgen`.",
        "`python -m hybridflow ...` is the same program. Exit codes: 0 ok, 2 an error (one",
        "line naming the config key, stage or service), 130 interrupted.",
        "",
        "## hybridflow",
        "",
        "```text",
        p.format_usage().strip(),
        "```",
        "",
        _arguments(p),
        "",
    ]
    for name, (sp, help_line) in subcommands(p).items():
        out += [
            f"## hybridflow {name}",
            "",
            cell(help_line[:1].upper() + help_line[1:]) + ("." if help_line else ""),
            "",
            "```text",
            sp.format_usage().strip(),
            "```",
            "",
            _arguments(sp),
            "",
        ]
    return "\n".join(out)

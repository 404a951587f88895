"""The docs site: the generated references cover what they claim, and the strict build passes.

The generators (scripts/docgen) run here as `mkdocs build` runs them: every option field
of the topology and of each backend's options has a doc (the few fields whose doc is owned
elsewhere are listed in `config_ref.PENDING`, and that list stays exact), the CLI reference
lists every subcommand of the parser, the step-logic reference every method and function
of the grammar, and the documented step-logic example compiles. The strict build runs
when mkdocs is importable (the `docs` extra, part of `dev`) and is skipped otherwise."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from docgen import cli_ref, config_ref, logic_ref, pages  # noqa: E402


def test_every_option_field_is_documented():
    missing = config_ref.undocumented()
    assert [m for m in missing if m not in config_ref.PENDING] == []
    assert sorted(config_ref.PENDING) == sorted(m for m in missing if m in config_ref.PENDING), (
        "a PENDING field has a doc now: remove it from config_ref.PENDING"
    )
    assert pages.problems() == []


def test_the_options_reference_covers_every_backend_and_source():
    from hybridflow.pipeline.sources.registry import SOURCES
    from hybridflow.stages import BACKENDS

    text = config_ref.render_options()
    for kind, backend in BACKENDS:
        assert f"### {kind}: {backend} " in text
    for name in SOURCES:
        assert f"### {name}\n" in text
    config = config_ref.render_config()
    for section in ("`run`", "`liveness`", "`transport`", "`checkpoint`", "`validation`"):
        assert f"## {section}" in config


def test_the_cli_reference_lists_every_subcommand_and_flag():
    parser = cli_ref.parser()
    text = cli_ref.render_cli()
    subs = cli_ref.subcommands(parser)
    assert {"run", "validate", "eval", "bench", "status", "demo"} <= set(subs)
    for name, (sp, _) in subs.items():
        assert f"## hybridflow {name}\n" in text
        for action in sp._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in text, f"{name} {flag}"


def test_the_logic_reference_lists_every_method_and_function():
    from hybridflow.pipeline.compiler import grammar

    text = logic_ref.render_logic()
    for (_, method), m in grammar.ROLE_METHODS.items():
        assert f".{method}`" in text and f"`{m.runtime_role}.{m.op}`" in text
    for name in grammar.ALGORITHMS:
        assert f"| `{name}` |" in text
    for kind in grammar.KINDS:
        assert f"| `{kind}` |" in text


def test_the_documented_logic_example_compiles():
    from hybridflow import DataflowBuilder

    df = DataflowBuilder("docs")
    df.add_actor("tiny", device_mapping="cpu")
    df.add_reference_model("tiny")
    df.add_reward_function("hybridflow.data.tasks:last_digit_reward")
    df.define_training_step(inputs=["prompt"], outputs=["loss", "rewards"], logic=logic_ref.EXAMPLE)
    assert any(op.op == "update" for op in df.compile().dataflow)


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs / mkdocs-material not installed (the docs extra)",
)
def test_the_strict_build_passes(tmp_path):
    env = {"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "reference" / "options" / "index.html").is_file()

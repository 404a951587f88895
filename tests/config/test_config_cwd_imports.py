"""Which modules `hybridflow validate` (and the coordinator) import, and from where.

- validate imports a function reward's `function:` as its stage will, so a missing
  module or attribute fails there with the key path (before: found at stage setup);
- `python -m hybridflow` does not import a `json.py` from the working directory into the
  coordinator (before: it did, `python -m` puts the working directory first);
- `--allow-cwd-imports` makes a reward module in the working directory importable under
  the console script too (before: the flag did nothing there, the console script never
  has the working directory on its path), and without it the module is refused.
The subprocess tests run the real entry points from a temporary working directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridflow import cli
from hybridflow.config.imports import PACKAGE_ROOT, cwd_off_path, stage_import_path

FUNCTION = "stages.reward.roles.reward.options.function"
CONSOLE = Path(sys.executable).with_name("hybridflow")
ENTRY_POINTS = {
    "console script": [str(CONSOLE)],
    "python -m": [sys.executable, "-m", "hybridflow"],
}


def topology(tmp_path: Path, function: str) -> Path:
    """synthetic rollout -> function reward -> synthetic actor, as a YAML file."""
    syn = "synthetic"
    data = {
        "name": "cwd",
        "run_dir": str(tmp_path / "run"),
        "run": {"steps": 1, "step_batch": 4, "micro_batch": 2},
        "data": {"fields": ["prompt_ids"]},
        "stages": {
            "rollout": {"roles": {"rollout": {"backend": syn}}},
            "reward": {
                "roles": {
                    "reward": {
                        "backend": "function",
                        "options": {"function": function, "tokenizer": "builtin"},
                    }
                }
            },
            "actor": {"roles": {"actor": {"backend": syn}}},
        },
        "dataflow": [
            {
                "role": "rollout",
                "op": "generate",
                "inputs": ["prompt_ids"],
                "outputs": ["response_ids"],
            },
            {
                "role": "reward",
                "op": "score",
                "inputs": ["prompt_ids", "response_ids"],
                "outputs": ["rewards"],
            },
            {"role": "actor", "op": "update", "inputs": ["prompt_ids", "response_ids", "rewards"]},
        ],
        "metrics": {"backends": ["memory"]},
    }
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)  # PYTHONPATH as given (a harness may set one): never the cwd
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("no_such_reward_module:score", "cannot import module 'no_such_reward_module'"),
        ("hybridflow.data.tasks:no_such_fn", "module 'hybridflow.data.tasks' has no attribute"),
        ("os:sep", "'os:sep' is a str, not callable"),
    ],
)
def test_validate_imports_the_reward_function_and_names_its_key(
    tmp_path, capsys, function, message
):
    assert cli.main(["validate", str(topology(tmp_path, function))]) == 2
    err = capsys.readouterr().err
    assert f"hybridflow: error: {FUNCTION}: " in err and message in err, err


def test_validate_accepts_an_importable_reward_function(tmp_path, capsys):
    fn = "hybridflow.data.tasks:last_digit_reward"
    assert cli.main(["validate", str(topology(tmp_path, fn))]) == 0
    assert capsys.readouterr().out.rstrip().endswith("ok")


@pytest.mark.slow
def test_a_json_py_in_the_working_directory_is_not_imported_by_python_m(tmp_path):
    """(The console script never had the working directory on its path.)"""
    marker = tmp_path / "imported"
    (tmp_path / "json.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\nraise SystemExit(7)\n"
    )
    cfg = topology(tmp_path, "hybridflow.data.tasks:last_digit_reward")
    res = run([*ENTRY_POINTS["python -m"], "validate", str(cfg)], tmp_path)
    assert res.returncode == 0, res.stderr
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_allow_cwd_imports_lets_a_reward_module_of_the_working_directory_load(tmp_path, entry):
    if entry == "console script" and not CONSOLE.exists():
        pytest.skip("no hybridflow console script beside this interpreter")
    marker = tmp_path / "imported"
    (tmp_path / "my_reward.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "def score(prompts, responses, prompt_ids, response_ids, metadata):\n"
        "    return [0.0] * len(responses)\n"
    )
    cmd = [*ENTRY_POINTS[entry], "validate", str(topology(tmp_path, "my_reward:score"))]
    refused = run(cmd, tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert f"{FUNCTION}: cannot import module 'my_reward'" in refused.stderr
    assert not marker.exists()
    allowed = run([*cmd, "--allow-cwd-imports"], tmp_path)
    assert allowed.returncode == 0, allowed.stderr
    assert marker.exists()


def test_cwd_off_path_takes_the_working_directory_off_and_allow_puts_it_last(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    cwd = os.path.realpath(tmp_path)
    monkeypatch.setattr(sys, "path", ["", cwd, *sys.path])
    before = list(sys.path)
    with cwd_off_path():
        assert not [p for p in sys.path if os.path.realpath(p or ".") == cwd]
    assert sys.path == before
    monkeypatch.setattr(sys, "path", [p for p in before if os.path.realpath(p or ".") != cwd])
    before = list(sys.path)
    with cwd_off_path(allow=True):
        assert sys.path == [*before, cwd]  # after installed packages: it shadows nothing
    assert sys.path == before


def test_stage_import_path_adds_the_directory_holding_the_package(monkeypatch):
    assert os.path.isdir(os.path.join(PACKAGE_ROOT, "hybridflow"))
    monkeypatch.setattr(
        sys, "path", [p for p in sys.path if os.path.realpath(p or ".") != PACKAGE_ROOT]
    )
    before = list(sys.path)
    with stage_import_path():
        assert sys.path == [*before, PACKAGE_ROOT]
    assert sys.path == before

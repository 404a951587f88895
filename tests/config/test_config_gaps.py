"""Config gaps an unlucky operator or an attacker hit (issue 12, item 8): each one is
refused with its dotted key, and nothing hangs or leaks a raw Python error.

Values, YAML structure (aliases, duplicate keys, nesting), the run directory (through
`hybridflow run`, which must exit 2 naming `run_dir`) and the step-logic parser."""

from __future__ import annotations

import time

import pytest

from hybridflow.cli import main
from hybridflow.config.loader import MAX_YAML_NODES, apply_overrides, parse_yaml
from hybridflow.config.schema import CheckpointConfig, load_topology
from hybridflow.errors import CompileError, ConfigError
from hybridflow.pipeline.compiler.frontend import compile_step
from hybridflow.pipeline.driver.expr import arith
from hybridflow.pipeline.plan.planner import build_plan

ACTOR = "stages.engine.roles.actor.options"


# -- values ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("liveness.heartbeat_timeout_s=.inf", "liveness.heartbeat_timeout_s: must be a finite"),
        ("liveness.heartbeat_interval_s=-.inf", "liveness.heartbeat_interval_s: must be a finite"),
        (f"{ACTOR}.lr=.nan", f"{ACTOR}.lr: must be a finite number, got nan"),
        ("seed=10000000000000000000000000", "seed: must be in 0 .. 2**63-1"),
        ("seed=-1", "seed: must be in 0 .. 2**63-1, got -1"),
        ("dataflow.3.params.norm_std=.nan", "dataflow[3].params.norm_std: must be a finite"),
        (
            f"{ACTOR}.model_overrides={{hidden_size: 100000000000}}",
            f"{ACTOR}.model_overrides.hidden_size: must be in 1 .. 1048576",
        ),
        (
            f"{ACTOR}.model_overrides={{hidden_size: 65536, num_hidden_layers: 1000}}",
            f"{ACTOR}.model_overrides: would make preset 'tiny' a model of",
        ),
        (f"{ACTOR}.model_overrides={{rope_theta: .inf}}", f"{ACTOR}.model_overrides.rope_theta"),
        (f"{ACTOR}.model_overrides={{hidden_size: 1.0e+30}}", "hidden_size: must be an int"),
        ("checkpoint.save_interval=-1", "checkpoint.save_interval: must be >= 0, got -1"),
    ],
)
def test_bad_values_are_refused_with_their_key(override, message):
    with pytest.raises(ConfigError) as info:
        build_plan(load_topology("grpo", [override]))  # what `hybridflow validate` does
    assert message in str(info.value)


def test_big_but_sane_values_still_load():
    topo = load_topology(
        "grpo",
        [
            "seed=9223372036854775807",
            f"{ACTOR}.model_overrides={{num_hidden_layers: 3}}",
            "liveness.heartbeat_timeout_s=1.0e+6",
        ],
    )
    build_plan(topo)
    assert topo.seed == 2**63 - 1
    assert CheckpointConfig().save_interval == 0  # the section is optional


# -- YAML structure ----------------------------------------------------------------------
def _bomb(levels: int = 9) -> str:
    """The billion laughs: 9 levels of 9 aliases = 9**9 strings from ~400 bytes."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    return "\n".join(["name: bomb", *lines]) + "\n"


@pytest.mark.timeout(10)
def test_alias_bomb_is_refused_fast_naming_the_file(tmp_path, capsys):
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb())
    assert len(path.read_bytes()) < 1024
    t0 = time.perf_counter()
    assert main(["validate", str(path)]) == 2
    assert time.perf_counter() - t0 < 5
    err = capsys.readouterr().err
    assert str(path) in err and f"more than {MAX_YAML_NODES} nodes" in err


@pytest.mark.timeout(10)
def test_alias_bomb_in_an_override_and_self_reference_are_refused():
    with pytest.raises(ConfigError, match=r"data\.options\.x: override value"):
        apply_overrides({}, ["data.options.x=" + _bomb().replace("\n", ", ").join("{}")])
    with pytest.raises(ConfigError, match=r"a\[0\]: f.yaml: an alias refers to a node"):
        parse_yaml("a: &a [*a]\n", "f.yaml")


def test_shared_aliases_below_the_bound_still_load():
    data = parse_yaml("base: &b {lr: 0.1, steps: 3}\nx: *b\ny: {<<: *b, steps: 4}\n", "f")
    assert data["x"] == {"lr": 0.1, "steps": 3} and data["y"] == {"lr": 0.1, "steps": 4}


def test_duplicate_keys_name_the_key_path_and_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("name: a\nrun:\n  steps: 2\n  step_batch: 8\n  steps: 5\n")
    with pytest.raises(ConfigError) as info:
        load_topology(path)
    assert info.value.path == "run.steps"
    assert f"duplicate key in {path}: line 3 and line 5" in str(info.value)


def test_deep_nesting_is_a_config_error_naming_the_file(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("name: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match=f"{path}: nested too deeply"):
        load_topology(path)


# -- the run directory -------------------------------------------------------------------
def test_uncreatable_run_dir_exits_2_naming_run_dir(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = main(["run", "grpo", "--set", f"run_dir={blocker / 'run'}", "--set", "run.steps=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "run_dir: cannot create directory" in err and "Traceback" not in err


def test_uncreatable_checkpoint_dir_names_its_key(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    args = ["--set", f"run_dir={tmp_path / 'run'}", "--set", f"checkpoint.save_dir={blocker}/c"]
    assert main(["run", "grpo", *args]) == 2
    assert "checkpoint.save_dir: cannot create directory" in capsys.readouterr().err


def test_resume_without_a_checkpoint_names_the_flag(tmp_path, capsys):
    assert main(["run", "grpo", "--set", f"run_dir={tmp_path}", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--resume: no checkpoint under" in err and str(tmp_path / "checkpoints") in err


# -- the step-logic parser ---------------------------------------------------------------
_HEAD = "response = actor.generate(prompt)\nscore = reward.score(prompt, response)\n"
_ROLES = ("rollout", "actor", "reward")


@pytest.mark.parametrize(
    "expression",
    [
        "+".join(["score"] * 900),  # RecursionError in the checks after parsing
        "+".join(["score"] * 100_000),  # RecursionError inside ast.parse
        "-" * 100_000 + "score",  # MemoryError inside ast.parse
        "score * (" * 90 + "score" + ")" * 90,
    ],
)
def test_deeply_nested_expression_is_a_compile_error_naming_its_line(expression):
    logic = _HEAD + f"x = {expression}\ny = score\n"
    with pytest.raises(CompileError) as info:
        compile_step(logic, ["prompt"], ["x"], _ROLES)
    assert info.value.line == 3
    assert "nested too deeply" in str(info.value)
    assert len(str(info.value)) < 400  # the 100 KB line is quoted by its start


def test_moderate_nesting_still_compiles_and_hand_written_arith_is_bounded():
    compile_step(_HEAD + "x = " + " + ".join(["score"] * 30), ["prompt"], ["x"], _ROLES)
    import torch

    from hybridflow.errors import BatchError

    with pytest.raises(BatchError, match="nested too deeply"):
        arith({"a": torch.ones(2)}, {"expr": "+".join(["a"] * 5000), "output": "c"})
    out, _ = arith({"a": torch.ones(2)}, {"expr": "a + a", "output": "c"})
    assert torch.equal(out["c"], torch.full((2,), 2.0))

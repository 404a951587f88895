"""Numbers in YAML configs are read as YAML 1.2 reads them (config/loader.py's docstring).

Before: PyYAML (YAML 1.1) read `lr: 1e-5` as the string '1e-5' and the float field said
"expected a number, got str '1e-5'", which reads as nonsense to the user who wrote a
number. Now `1e-5` is a float everywhere (files, --set values, options of any type); a
number the user did quote is an error that says so.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import hybridflow.config
from hybridflow.config.loader import parse_yaml
from hybridflow.config.schema import load_topology
from hybridflow.errors import ConfigError
from hybridflow.pipeline.plan.planner import build_plan
from hybridflow.stages.actor import ActorOptions

ACTOR = "stages.engine.roles.actor.options"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1e-9", 1e-9),
        ("3E5", 3e5),
        ("1.0e5", 1e5),  # YAML 1.1 wants a sign in the exponent too
        ("-2e-3", -2e-3),
        ("+4e2", 400.0),
        (".5e1", 5.0),
        ("1_000e2", 1e5),
        ("1.5", 1.5),  # unchanged: these were floats already
        ("12", 12),
    ],
)
def test_plain_numbers_with_an_exponent_are_floats(text, value):
    got = parse_yaml(f"x: {text}", "t")["x"]
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text", ['"1e-9"', "'3E5'", "1e", "e5", "1e-9x", "0x1e5z"])
def test_quoted_or_malformed_ones_stay_strings(text):
    assert isinstance(parse_yaml(f"x: {text}", "t")["x"], str)


def test_pyyaml_itself_is_left_as_it_was():
    assert yaml.safe_load("x: 1e-9") == {"x": "1e-9"}


def test_a_topology_file_with_exponent_numbers_loads_them_as_numbers(tmp_path):
    preset = Path(hybridflow.config.__file__).parent / "presets" / "grpo.yaml"
    text = preset.read_text()
    assert "lr: 3.0e-3" in text
    path = tmp_path / "t.yaml"
    path.write_text(text.replace("lr: 3.0e-3", "lr: 1e-5"))
    topo = load_topology(
        str(path),
        ["liveness.heartbeat_timeout_s=6E1", f"{ACTOR}.model_overrides={{rope_theta: 1e6}}"],
    )
    build_plan(topo)
    options = topo.stages["engine"].roles["actor"].options
    assert options["lr"] == 1e-5 and topo.liveness.heartbeat_timeout_s == 60.0
    assert options["model_overrides"] == {"rope_theta": 1e6}  # an untyped field: a float too


@pytest.mark.parametrize(
    ("setting", "key", "message"),
    [
        (f'{ACTOR}.lr="1e-5"', f"{ACTOR}.lr", "a quoted number; write it without quotes (1e-5)"),
        ('run.steps="3"', "run.steps", "a quoted number; write it without quotes (3)"),
        (f"{ACTOR}.lr=fast", f"{ACTOR}.lr", "expected a number, got str 'fast'"),
    ],
)
def test_a_quoted_number_in_a_numeric_field_is_an_error_that_says_so(setting, key, message):
    with pytest.raises(ConfigError) as info:
        build_plan(load_topology("grpo", [setting]))
    assert info.value.path == key and message in str(info.value)
    if "fast" in setting:
        assert "quoted number" not in str(info.value)


def test_options_classes_read_the_same_numbers():
    from hybridflow.config.loader import from_dict

    opts = from_dict(ActorOptions, parse_yaml("{model: tiny, lr: 3e-4}", "t"), "o")
    assert opts.lr == 3e-4

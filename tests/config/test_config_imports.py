"""The one `"package.module:attr"` loader: syntax, missing module/attribute, callables,
and the dotted config key in every error."""

from __future__ import annotations

import os.path

import pytest

from hybridflow.config.imports import load_attr, split_spec
from hybridflow.errors import ConfigError


def test_loads_a_module_attribute_and_a_dotted_attribute():
    assert load_attr("os.path:join", "k") is os.path.join
    assert load_attr("os:path.join", "k") is os.path.join
    assert load_attr("hybridflow.config.imports:load_attr", "k", callable_only=True) is load_attr


def test_split_spec_checks_the_syntax_without_importing():
    assert split_spec("no_such_pkg.mod:fn", "k") == ("no_such_pkg.mod", "fn")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "must look like 'package.module:attr', got 'no_colon'"),
        (":fn", "must look like 'package.module:attr'"),
        ("mod:", "must look like 'package.module:attr'"),
        ("a:b:c", "must look like 'package.module:attr'"),
        (3, "must look like 'package.module:attr', got 3"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("os.path:no_such_fn", "module 'os.path' has no attribute 'no_such_fn'"),
        ("os:sep", "is a str, not callable"),
    ],
)
def test_errors_name_the_dotted_key(spec, message):
    with pytest.raises(ConfigError) as info:
        load_attr(spec, "stages.reward.roles.reward.options.function", callable_only=True)
    assert info.value.path == "stages.reward.roles.reward.options.function"
    assert message in str(info.value)

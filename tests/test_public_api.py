"""The public API: every package's `__all__` names something that exists (once), the top
level is exactly the documented set, and `import hybridflow` stays light (lazy API)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PACKAGES = [
    "hybridflow",
    "hybridflow.algos",
    "hybridflow.bench",
    "hybridflow.config",
    "hybridflow.data",
    "hybridflow.models",
    "hybridflow.pipeline",
    "hybridflow.reward",
    "hybridflow.stages",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_every_name_in_all_exists_once(name: str) -> None:
    mod = importlib.import_module(name)
    names = list(mod.__all__)
    assert len(names) == len(set(names)), f"{name}.__all__ repeats a name"
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{name}.__all__ names what it does not have: {missing}"


def test_the_top_level_api_is_the_documented_set() -> None:
    import hybridflow

    assert sorted(hybridflow.__all__) == ["DataflowBuilder", "Engine", "__version__"]
    from hybridflow.pipeline.api.builder import DataflowBuilder
    from hybridflow.pipeline.api.engine import Engine

    assert hybridflow.DataflowBuilder is DataflowBuilder and hybridflow.Engine is Engine
    with pytest.raises(AttributeError, match="no attribute 'Builder'"):
        _ = hybridflow.Builder  # type: ignore[attr-defined]


def test_importing_hybridflow_does_not_import_torch() -> None:
    code = "import sys, hybridflow; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]

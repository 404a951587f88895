"""docs/extending.md runs as written: its snippets, put together as the page says (one
file, `my_ext.py`), give what the page prints for the role backend and the driver op,
and the topology of its last section (the driver op in the dataflow, the registered sink
beside jsonl) plans. The page's whole run (real processes, about 10 s) was run by hand."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "extending.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def _one(blocks: list[str], needle: str) -> str:
    (block,) = [b for b in blocks if needle in b]
    return block


def test_the_snippets_of_the_extending_page_run_as_written(tmp_path: Path) -> None:
    blocks = _blocks()
    parts = ("import json", "class LengthReward", "def clip_rewards", "class CountingPrompts")
    module = [_one(blocks, p) for p in parts] + [_one(blocks, "class RewardLog")]
    (tmp_path / "my_ext.py").write_text("\n\n".join(module))
    (tmp_path / "handle.py").write_text(_one(blocks, "role.handle("))
    run_all = _one(blocks, "run_topology(")
    # the last section, planned instead of run: everything up to the run itself
    plan = run_all.split("result = run_topology")[0] + (
        "from hybridflow.pipeline.plan.planner import build_plan\n"
        "print([op.label for op in build_plan(load_topology(raw)).ops][2])\n"
    )
    (tmp_path / "plan.py").write_text(plan)
    env = {"PYTHONPATH": str(tmp_path), "PATH": str(Path(sys.executable).parent)}
    out = [
        subprocess.run(
            [sys.executable, script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        for script in ("handle.py", "plan.py")
    ]
    for done in out:
        assert done.returncode == 0, done.stderr[-3000:]
    handled, ops, clipped = out[0].stdout.splitlines()
    assert "'rewards': tensor([1.0000, 0.5000])" in handled
    assert "'reward/length_mean': 2.5" in handled
    assert ops == "['score']"
    assert "'clipped': tensor([0.5000, 1.0000])" in clipped and "0.5}" in clipped
    assert out[1].stdout.strip() == "driver.my_ext:clip_rewards"

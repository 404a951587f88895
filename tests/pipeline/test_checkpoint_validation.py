"""Reading a checkpoint validates before it trusts (issue 22): `latest` must name a
checkpoint directory inside save_dir, meta.json is parsed strictly, every safetensors file
is checked (size, header) before a byte is loaded, and each failure is one line naming
the file and the key (a ConfigError: exit 2 through the CLI). A damaged newest checkpoint
is refused, never silently replaced by an older one.

Checkpoints here are built in-process with the checkpoint package's own writers
(checkpointer.py, stage.py; a trainer role's shards through DCP), with the meta.json of
the `grpo` preset's topology, so a sound one passes `resume_point` exactly as
`hybridflow run grpo --resume latest` checks it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridflow.config.schema import CheckpointConfig, load_topology
from hybridflow.errors import ConfigError
from hybridflow.pipeline.checkpoint.checkpointer import Checkpointer
from hybridflow.pipeline.checkpoint.resume import read_meta
from hybridflow.pipeline.checkpoint.stage import policy_weights, save_stage
from hybridflow.pipeline.checkpoint.tree import read_state
from hybridflow.pipeline.runtime.runner import resume_point
from hybridflow.stages.contract import RoleBase
from hybridflow.stages.parallel import checkpoint as shard_ckpt


class Trainer(RoleBase):
    """Stands for a trainer role: state JSON + tensors, and DCP weight shards."""

    writes_shards = True

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(16, 16)
        self.optimizer = torch.optim.AdamW(self.model.parameters())

    def save_shards(self, directory: Path) -> dict[str, Any]:
        return shard_ckpt.save(self.model, self.optimizer, directory, alone=True)

    def load_shards(self, directory: Path, extra: dict[str, Any]) -> None:
        shard_ckpt.load(self.model, self.optimizer, directory, extra, alone=True)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": torch.ones(32), "updates": 3}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


class Plain(RoleBase):
    def state_dict(self) -> dict[str, Any]:
        return {"seen": 5}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def _topology(save_dir: Path):  # type: ignore[no-untyped-def]
    return load_topology("grpo", [f"checkpoint.save_dir={save_dir}"])


def _save(save_dir: Path, step: int) -> Path:
    """A complete checkpoint after `step` (steps done: step + 1), committed as a run does."""
    topo = _topology(save_dir)
    c = Checkpointer(CheckpointConfig(str(save_dir), save_interval=1), last_step=10)
    tmp = c.begin(step)
    roles = {"rollout": Plain(), "actor": Trainer(), "reference": Plain()}
    save_stage(roles, tmp, "engine", 0)
    save_stage({"reward": Plain()}, tmp, "reward", 0)
    return c.commit(tmp, c.meta(step, topo, policy_version=step + 1))


@pytest.fixture
def save_dir(tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    _save(root, 1)  # step-00000002
    _save(root, 3)  # step-00000004, `latest`
    return root


def _shard(checkpoint: Path) -> Path:
    (path,) = (checkpoint / "shards" / "engine.actor").glob("*.safetensors")
    return path


def _refused(save_dir: Path, spec: str = "latest") -> str:
    """resume_point's error for `spec`: a ConfigError whose text is one line."""
    with pytest.raises(ConfigError) as info:
        resume_point(_topology(save_dir), spec)
    text = str(info.value)
    assert "\n" not in text, text
    return text


def test_a_sound_checkpoint_resolves_and_resumes(save_dir):
    path, step = resume_point(_topology(save_dir), "latest")
    assert (Path(path).name, step) == ("step-00000004", 4)
    meta = read_meta(Path(path))
    assert meta["step"] == 4 and meta["actor"] == {"stage": "engine", "role": "actor"}


# -- latest ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content", [b"\x00\xff\xfe garbage \x81", b"", b"step-4\n", b"step-00000009\n"]
)
def test_a_corrupt_latest_is_one_line_naming_it(save_dir, content):
    (save_dir / "latest").write_bytes(content)
    text = _refused(save_dir)
    assert text.startswith(f"--resume: {save_dir / 'latest'}"), text
    if content == b"step-00000009\n":
        assert "does not exist" in text and "step-00000004" in text, text  # names the newest


@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_latest_pointing_outside_save_dir_is_refused(tmp_path, save_dir, how):
    other = _save(tmp_path / "elsewhere", 5)  # a sound checkpoint, of another save_dir
    if how == "relative":
        (save_dir / "latest").write_text(f"../elsewhere/{other.name}\n")
    elif how == "absolute":
        (save_dir / "latest").write_text(f"{other}\n")
    else:
        os.symlink(other, save_dir / other.name)
        (save_dir / "latest").write_text(f"{other.name}\n")
    text = _refused(save_dir)
    assert text.startswith(f"--resume: {save_dir / 'latest'}"), text
    assert "outside" in text and str(save_dir) in text, text


def test_a_missing_meta_json_is_no_silent_fallback(save_dir):
    (save_dir / "step-00000004" / "meta.json").unlink()
    text = _refused(save_dir)
    assert "step-00000004" in text and "meta.json" in text, text
    # says which complete one there is, and how to take it
    assert str(save_dir / "step-00000002") in text, text


def test_without_latest_the_newest_complete_checkpoint_is_used_and_said(save_dir, caplog):
    (save_dir / "latest").unlink()
    with caplog.at_level(logging.WARNING, logger="hybridflow.checkpoint"):
        path, step = resume_point(_topology(save_dir), "latest")
    assert (Path(path).name, step) == ("step-00000004", 4)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "step-00000004" in said and "no `latest`" in said, said


# -- meta.json -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("step", "four"),
        ("step", True),
        ("step", 0),
        ("policy_version", -1),
        ("seed", 1.5),
        ("actor", "engine"),
        ("config", None),
        ("stpe", 4),  # an unknown key
    ],
)
def test_meta_json_with_a_bad_value_names_the_file_and_the_key(save_dir, key, value):
    meta_file = save_dir / "step-00000004" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta[key] = value
    meta_file.write_text(json.dumps(meta))
    text = _refused(save_dir)
    assert text.startswith(f"--resume: {meta_file}: "), text
    assert f"'{key}'" in text, text


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"format": 1, "step": 4'])
def test_meta_json_that_is_no_object_is_one_line(save_dir, content):
    meta_file = save_dir / "step-00000004" / "meta.json"
    meta_file.write_text(content)
    text = _refused(save_dir)
    assert text.startswith(f"--resume: {meta_file}: "), text


def test_a_missing_required_key_is_named(save_dir):
    meta_file = save_dir / "step-00000004" / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["policy_version"]
    meta_file.write_text(json.dumps(meta))
    text = _refused(save_dir)
    assert text.startswith(f"--resume: {meta_file}: ") and "'policy_version'" in text, text


# -- safetensors files -----------------------------------------------------------------------


def _truncate(path: Path, keep: float = 0.5) -> None:
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(int(size * keep))


def test_a_truncated_shard_is_one_line_naming_the_file(save_dir):
    shard = _shard(save_dir / "step-00000004")
    _truncate(shard)
    text = _refused(save_dir)
    assert text.startswith(f"--resume: checkpoint file {shard} is truncated"), text
    assert "tensor '" in text, text  # names the key whose bytes are missing


@pytest.mark.parametrize(
    "damage",
    ["header_length", "header_json", "too_long", "state_blob"],
)
def test_other_damaged_safetensors_files_are_one_line_naming_the_file(save_dir, damage):
    root = save_dir / "step-00000004"
    target = _shard(root)
    raw = target.read_bytes()
    if damage == "header_length":
        raw = (1 << 40).to_bytes(8, "little") + raw[8:]
    elif damage == "header_json":
        n = int.from_bytes(raw[:8], "little")
        raw = raw[:8] + b"#" * n + raw[8 + n :]
    elif damage == "too_long":
        raw += b"\0" * 64
    else:
        target = root / "stages" / "engine-0" / "actor.safetensors"
        raw = target.read_bytes()[:20]
    target.write_bytes(raw)
    text = _refused(save_dir)
    assert text.startswith(f"--resume: checkpoint file {target} "), text
    assert text.count("checkpoint file") == 1, text  # one cause, said once


def test_the_stage_side_readers_check_the_files_too(save_dir):
    """A stage given `resume_dir` directly (the Python API, a resumed session) meets the
    same checks: one line naming the file, never DCP's BaseException."""
    root = save_dir / "step-00000004"
    shard = _shard(root)
    _truncate(shard)
    trainer = Trainer()
    with pytest.raises(ConfigError, match=re.escape(f"checkpoint file {shard} is truncated")):
        trainer.load_shards(shard.parent, {})
    with pytest.raises(ConfigError, match=re.escape(f"checkpoint file {shard} is truncated")):
        policy_weights(root)
    blob = root / "stages" / "engine-0" / "actor.safetensors"
    _truncate(blob)
    with pytest.raises(ConfigError, match=re.escape(f"checkpoint file {blob} is truncated")):
        read_state(blob.parent, "actor")
    (root / "stages" / "engine-0" / "rng.json").write_text("{oops")
    with pytest.raises(ConfigError, match=re.escape("rng.json is unreadable")):
        read_state(blob.parent, "rng")


def test_a_sound_shard_loads_back_bit_exactly(save_dir):
    root = save_dir / "step-00000004"
    saved = Trainer()
    fresh = Trainer()
    with torch.no_grad():
        fresh.model.weight.zero_()
    fresh.load_shards(root / "shards" / "engine.actor", {})
    assert torch.equal(fresh.model.weight, saved.model.weight)


# -- through the CLI: exit 2, one line -------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["truncated_shard", "bad_step"])
def test_the_cli_refuses_a_damaged_checkpoint_in_one_line_exit_2(tmp_path, save_dir, damage):
    root = save_dir / "step-00000004"
    if damage == "truncated_shard":
        _truncate(_shard(root))
        named = str(_shard(root))
    else:
        meta = json.loads((root / "meta.json").read_text())
        meta["step"] = "four"
        (root / "meta.json").write_text(json.dumps(meta))
        named = str(root / "meta.json")
    cmd = [sys.executable, "-m", "hybridflow", "run", "grpo", "--resume", "latest"]
    cmd += ["--set", f"checkpoint.save_dir={save_dir}", "--set", f"run_dir={tmp_path / 'run'}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"hybridflow: error: --resume: {named}") or (
        lines[0].startswith("hybridflow: error: --resume: checkpoint file ") and named in lines[0]
    ), lines[0]


# -- in a stage process ------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_stage_resuming_from_a_truncated_file_fails_in_one_line(topo_dict, tmp_path):
    """A stage handed the checkpoint directly (`resume_dir`, as the Python API and a
    session do) checks each file it reads: the run ends with one line naming the stage
    and the file, and no remote traceback."""
    from pipeline_helpers import RecordingLauncher, leftovers

    from hybridflow.errors import StageError
    from hybridflow.pipeline.runtime.runner import run_topology

    data = topo_dict(steps=2)
    data["checkpoint"] = {"save_dir": str(tmp_path / "ck"), "save_interval": 1}
    result = run_topology(load_topology(data))
    first = Path(result.checkpoints[0])
    blob = first / "stages" / "reward-0" / "rng.safetensors"
    _truncate(blob)
    launcher, run_id = RecordingLauncher(), uuid.uuid4().hex[:12]
    with pytest.raises(StageError) as info:
        run_topology(
            load_topology(data),
            start_step=1,
            resume_dir=str(first),
            launcher=launcher,
            run_id=run_id,
        )
    err = info.value
    text = str(err)
    assert text.startswith(
        "stage reward replica 0 failed during setup: ConfigError: resume_from: "
        f"checkpoint file {blob} is truncated: "
    ), text
    assert "\n" not in text and not err.remote_traceback, text
    assert not leftovers(run_id, launcher.started)

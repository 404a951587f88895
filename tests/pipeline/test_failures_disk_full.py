"""A checkpoint save on a full disk fails at once, naming the path (issue 22).

Once, torch's CheckpointException (a BaseException) killed the weight-shard write unseen
and the run waited `liveness.control_timeout_s` (600 s) to blame "slow storage"; an
ENOSPC while committing `latest` named no path and left `.tmp-latest-*` behind.

The seams are hit with a real ENOSPC: a file that is a symlink to /dev/full (any user),
and, when running as root, a whole `hybridflow run grpo` saving onto a 1 MiB tmpfs.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybridflow.config.schema import CheckpointConfig
from hybridflow.pipeline.checkpoint.checkpointer import Checkpointer
from hybridflow.pipeline.checkpoint.layout import FORMAT
from hybridflow.pipeline.checkpoint.tree import write_state
from hybridflow.stages.parallel import checkpoint as shard_ckpt

FULL = Path("/dev/full")
needs_dev_full = pytest.mark.skipif(not FULL.exists(), reason="no /dev/full")


def _full(path: Path) -> Path:
    """`path` as a file whose every write fails with ENOSPC."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(FULL, path)
    return path


@needs_dev_full
def test_weight_shards_on_a_full_disk_are_an_os_error_naming_the_directory(tmp_path):
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    shards = tmp_path / "shards" / "engine.actor"
    _full(shards / "shard-00001-model-00001-of-00001.safetensors")
    with pytest.raises(OSError) as info:  # an Exception, not DCP's BaseException
        shard_ckpt.save(model, opt, shards, alone=True)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(shards)
    assert "No space left on device" in str(info.value) and "weight shards" in str(info.value)


@needs_dev_full
def test_a_state_file_on_a_full_disk_names_the_file(tmp_path):
    target = _full(tmp_path / "actor.json")
    with pytest.raises(OSError) as info:
        write_state({"w": torch.ones(4), "step": 3}, tmp_path, "actor")
    assert info.value.errno == errno.ENOSPC, info.value
    assert info.value.filename == str(target)


def test_a_safetensors_file_on_a_full_disk_names_the_file(tmp_path, monkeypatch):
    """safetensors replaces a symlink rather than writing through it, and reports I/O
    errors as text: on a real full tmpfs (root) or with the text it gives there."""
    if os.geteuid() == 0:
        out = tmp_path / "full"
        out.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(out)], check=True)
    else:
        from safetensors import SafetensorError

        out = tmp_path

        def full_disk(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )

        monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    try:
        with pytest.raises(OSError) as info:
            write_state({"w": torch.ones(64 << 10)}, out, "actor")  # 256 KiB
        assert info.value.errno == errno.ENOSPC, info.value
        assert info.value.filename == str(out / "actor.safetensors")
    finally:
        if out != tmp_path:
            subprocess.run(["umount", "-l", str(out)], check=False)


def test_enospc_while_committing_latest_names_it_and_leaves_no_temporary(tmp_path, monkeypatch):
    c = Checkpointer(CheckpointConfig(str(tmp_path), save_interval=1), last_step=3)
    first = c.commit(c.begin(0), {"format": FORMAT, "step": 1})
    write_text = Path.write_text

    def full_disk(self: Path, text: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.name.startswith(".tmp-latest"):
            self.touch()  # created, then the write fails: what a full disk does
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError) as info:
        c.commit(c.begin(1), {"format": FORMAT, "step": 2})
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(tmp_path / "latest")
    assert not list(tmp_path.glob(".tmp-*")), list(tmp_path.iterdir())
    # `latest` still names the last checkpoint it named; the new one is complete anyway.
    assert (tmp_path / "latest").read_text().strip() == first.name
    assert (tmp_path / "step-00000002" / "meta.json").is_file()


def test_a_stale_temporary_latest_is_swept_by_the_next_save(tmp_path):
    c = Checkpointer(CheckpointConfig(str(tmp_path), save_interval=1), last_step=3)
    (tmp_path / ".tmp-latest-abc123").write_text("step-00000001\n")  # an older crash's
    c.begin(0)
    assert [p.name for p in tmp_path.glob(".tmp-latest*")] == []


# -- a whole run on a full disk (root: a real tmpfs) ----------------------------------------


@pytest.fixture
def tiny_tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the /dev/full tests cover the seams)")
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.timeout(300)
def test_a_save_on_a_full_tmpfs_fails_at_once_naming_the_stage_and_the_path(tmp_path, tiny_tmpfs):
    control_timeout = 240
    sets = [
        f"run_dir={tmp_path / 'run'}",
        "run.steps=3",
        "run.step_batch=16",
        "run.micro_batch=8",
        "metrics.backends=[jsonl]",
        "checkpoint.save_interval=1",
        f"checkpoint.save_dir={tiny_tmpfs / 'ck'}",
        f"liveness.control_timeout_s={control_timeout}",
    ]
    cmd = [sys.executable, "-m", "hybridflow", "run", "grpo"]
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    took = time.monotonic() - t0
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("hybridflow: error: ")]
    assert done.returncode == 2 and lines, done.stderr[-4000:]
    line = lines[-1]
    assert "stage engine replica 0 failed in control.checkpoint_save at step 0" in line, line
    assert "OSError: [Errno 28] No space left on device" in line, line
    assert str(tiny_tmpfs / "ck") in line, line  # the path
    assert "control_timeout_s" not in line, line
    assert took < control_timeout, f"{took:.0f}s: the failure waited for the control bound"

"""The coordinator's side of checkpoints: when to save, the atomic commit, driver state.

The coordinator (`Checkpointer`) decides when (`due`), creates the temporary directory
(`begin`), asks every stage process to write its part into it (stage.py `save_stage`,
run inside the stage), writes its own driver ops' state (`save_drivers`), then writes
meta.json and commits (`commit`: rename to step-*, replace `latest`, prune to
`keep_last`). Where each part lies: layout.py.

Writing names what it could not write: a failed write is an OSError with the errno
(ENOSPC on a full disk) and the file's path; a failed commit leaves nothing temporary.
Invariant: a directory named step-* that exists is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridflow.config.schema import CheckpointConfig
from hybridflow.errors import ConfigError, PipelineError
from hybridflow.pipeline.checkpoint.layout import FORMAT, PREFIX, TMP, list_checkpoints
from hybridflow.pipeline.checkpoint.tree import read_state, write_state, writing
from hybridflow.stages.base import backend_class


def save_drivers(drivers: Mapping[int, Any], root: Path) -> None:
    """State of the driver ops that keep any (`state_dict()`), e.g. an adaptive KL
    coefficient, under `coordinator/driver-<op index>`."""
    out = root / "coordinator"
    for index, fn in drivers.items():
        if callable(getattr(fn, "state_dict", None)):
            out.mkdir(parents=True, exist_ok=True)
            write_state(fn.state_dict(), out, f"driver-{index}")


def load_drivers(drivers: Mapping[int, Any], root: Path) -> None:
    src = root / "coordinator"
    for index, fn in drivers.items():
        if (src / f"driver-{index}.json").is_file():
            if not callable(getattr(fn, "load_state_dict", None)):
                raise PipelineError(
                    f"checkpoint {root} holds state for driver op {index}, which cannot load it"
                )
            fn.load_state_dict(read_state(src, f"driver-{index}"))


class Checkpointer:
    """Coordinator-side bookkeeping: when to save, where, and the atomic commit."""

    def __init__(
        self, cfg: CheckpointConfig, last_step: int, extra: dict[str, Any] | None = None
    ) -> None:
        cfg.validate()
        if not cfg.save_dir:
            raise ConfigError("save_path", "is required")
        self.cfg = cfg
        self.root = Path(cfg.save_dir)
        self.last_step = last_step  # index of the run's final step
        self.extra = dict(extra or {})  # JSON-able, stored in meta.json (e.g. the logic)

    def meta(self, step: int, topo: Any, policy_version: int) -> dict[str, Any]:
        """meta.json of the checkpoint taken after `step` (steps done: step + 1)."""
        from hybridflow.config.loader import to_dict
        from hybridflow.version import __version__

        actor = next(
            (
                {"stage": stage, "role": role}
                for stage, cfg in topo.stages.items()
                for role, rc in cfg.roles.items()
                if backend_class(rc.kind_of(role), rc.backend).exports_policy
            ),
            None,
        )
        return {
            "format": FORMAT,
            "hybridflow": __version__,
            "step": step + 1,
            "seed": topo.seed,
            "policy_version": policy_version,
            "data": {"next_step": step + 1, "samples_seen": (step + 1) * topo.run.step_batch},
            "actor": actor,
            "created": time.time(),
            "config": to_dict(topo),
            "extra": self.extra,
        }

    def due(self, step: int) -> bool:
        """Save after step `step` finished? (every save_interval steps, and at the end)"""
        if step == self.last_step:
            return True
        n = self.cfg.save_interval
        return n > 0 and (step + 1) % n == 0

    def next_due(self, step: int) -> int:
        """The first step >= `step` after which a checkpoint is taken."""
        s = step
        while not self.due(s):
            s += 1
        return s

    def begin(self, step: int) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"{TMP}*"):  # an earlier crash mid-save
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:  # a `latest` pointer that was never moved into place
                stale.unlink(missing_ok=True)
        tmp = self.root / f"{TMP}{PREFIX}{step + 1:08d}-{uuid.uuid4().hex[:6]}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, meta: dict[str, Any]) -> Path:
        """meta.json, rename to step-*, then `latest`. A failed write is an OSError naming
        the file it was for; nothing temporary stays behind (a partial checkpoint is
        removed: on a full disk its space is what the user needs back)."""
        try:
            with writing(tmp / "meta.json"):
                (tmp / "meta.json").write_text(json.dumps(meta, indent=1, allow_nan=False))
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        final = self.root / f"{PREFIX}{int(meta['step']):08d}"
        if final.exists():  # the same step saved again (a re-run): replace it whole
            trash = self.root / f"{TMP}old-{uuid.uuid4().hex[:6]}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        # From here `final` is complete; `latest` names it once the pointer is in place.
        pointer = self.root / f"{TMP}latest-{uuid.uuid4().hex[:6]}"
        try:
            with writing(self.root / "latest"):
                pointer.write_text(final.name + "\n")
                os.replace(pointer, self.root / "latest")
        except OSError:
            pointer.unlink(missing_ok=True)
            raise
        self._prune(keep=final)
        return final

    def _prune(self, keep: Path) -> None:
        if self.cfg.keep_last <= 0:
            return
        done = list_checkpoints(self.root)
        for old in done[: max(0, len(done) - self.cfg.keep_last)]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

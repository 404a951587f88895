"""Finding and checking a checkpoint before a resume trusts it.

Reading validates before it trusts (`resolve`, run before any stage starts, and the
stage-side readers again, stage.py): `latest` must name a complete `step-*` directory of
save_dir itself; meta.json is parsed strictly (`_META`, as `Checkpointer.meta` writes it);
every safetensors file's header and size are checked (stages/parallel/checkpoint.py
`check_file`) and every JSON state file parses. Each refusal is one line, a ConfigError
naming the file and the key. A damaged newest checkpoint is refused, never silently
replaced by an older one; only a save_dir without any `latest` resumes its newest
complete checkpoint, with a warning that says so. `stage_layout` is what a run resuming a
checkpoint must have in common with the run that wrote it (its stages, replicas, roles).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridflow.errors import ConfigError
from hybridflow.pipeline.checkpoint.layout import FORMAT, PREFIX, list_checkpoints
from hybridflow.pipeline.checkpoint.tree import read_json

log = logging.getLogger("hybridflow.checkpoint")


def resolve(resume_from: str | Path, save_dir: str | Path | None = None) -> Path:
    """`"latest"` (under `save_dir`), a checkpoint directory, or a save_dir (its latest)
    -> a checkpoint directory whose files passed `check_files`.

    Validates before it trusts: a `latest` that names no complete checkpoint directory
    inside its save_dir is refused (`_latest`), never replaced by an older checkpoint
    without a word. Every refusal is a one-line ConfigError naming the file at fault."""
    if str(resume_from) == "latest":
        if save_dir is None:
            raise ConfigError("resume_from", "'latest' needs a save_path (save_checkpoint)")
        path = _latest(Path(save_dir))
    else:
        path = Path(resume_from)
        if not (path / "meta.json").is_file():
            pointer = path / "latest"
            if not (path.is_dir() and (pointer.exists() or list_checkpoints(path))):
                raise ConfigError(
                    "resume_from", f"{str(path)!r} is not a checkpoint (no meta.json)"
                )
            path = _latest(path)  # a save_dir: its latest
    check_files(path)
    return path


_NAME = re.compile(rf"{PREFIX}\d{{8}}")


def _latest(root: Path) -> Path:
    """The checkpoint `root/latest` names: a directory `step-NNNNNNNN` of `root` itself
    (not a path elsewhere, not a link out of it) holding a meta.json. Without a `latest`
    (a save that died before writing it, a directory copied by hand) the newest complete
    checkpoint is used, and a warning says so and why."""
    pointer = root / "latest"
    if not pointer.exists() and not pointer.is_symlink():
        done = list_checkpoints(root)
        if not done:
            raise ConfigError("resume_from", f"no checkpoint under {str(root)!r} to resume from")
        log.warning(
            "%s has no `latest` pointer: resuming from %s, the newest complete checkpoint there",
            root,
            done[-1],
        )
        return done[-1]
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except OSError as exc:
        raise ConfigError("resume_from", f"{pointer}: cannot be read: {exc}") from exc
    except UnicodeDecodeError:
        raise ConfigError(
            "resume_from",
            f"{pointer}: is not text; it must hold the name of a checkpoint directory of "
            f"{root} ({PREFIX}NNNNNNNN)" + _newest(root, ""),
        ) from None
    shown = repr(name if len(name) <= 80 else name[:80] + "...")
    if "/" in name or os.sep in name or name in (".", ".."):
        raise ConfigError(
            "resume_from",
            f"{pointer}: names {shown}, a path outside {root}; `latest` must name a "
            f"checkpoint directory inside its save_dir ({PREFIX}NNNNNNNN)",
        )
    if not _NAME.fullmatch(name):
        raise ConfigError(
            "resume_from",
            f"{pointer}: names {shown}, which is not a checkpoint directory name "
            f"({PREFIX}NNNNNNNN)" + _newest(root, name),
        )
    path = root / name
    if path.exists() and path.resolve().parent != root.resolve():
        raise ConfigError(
            "resume_from",
            f"{pointer}: names {name}, a link to {path.resolve()}, outside {root}; `latest` "
            "must name a checkpoint directory inside its save_dir",
        )
    if not path.is_dir():
        raise ConfigError(
            "resume_from", f"{pointer}: names {name}, which does not exist" + _newest(root, name)
        )
    if not (path / "meta.json").is_file():
        raise ConfigError(
            "resume_from",
            f"{pointer}: names {name}, which has no meta.json (an incomplete or damaged "
            "checkpoint)" + _newest(root, name),
        )
    return path


def _newest(root: Path, but: str) -> str:
    """What a refusal of `latest` can offer instead: the newest complete checkpoint."""
    done = [p for p in list_checkpoints(root) if p.name != but]
    if not done:
        return f"; there is no other complete checkpoint under {root}"
    return f"; the newest complete checkpoint is {done[-1]}: resume from that directory"


def check_files(root: Path) -> None:
    """Every file a resume reads, checked before any is loaded: each safetensors file
    (header, tensor sizes, file size: `check_file`) and each JSON state file parses."""
    from hybridflow.stages.parallel.checkpoint import check_file

    for path in sorted(root.rglob("*.safetensors")):
        check_file(path)
    for part in ("stages", "coordinator"):
        for path in sorted((root / part).rglob("*.json")):
            read_json(path)


def stage_layout(stages: Mapping[str, Any]) -> dict[str, Any]:
    """stage -> (replicas, sorted roles) of a topology's `stages` as plain data: what a
    checkpoint's parts are keyed by, so what a run resuming it must have."""
    return {
        name: (int(cfg.get("replicas", 1)), sorted(cfg.get("roles", {})))
        for name, cfg in stages.items()
    }


def _nonneg_int(v: Any) -> bool:
    return type(v) is int and v >= 0


def _is_actor(v: Any) -> bool:
    return v is None or (
        isinstance(v, dict)
        and set(v) == {"stage", "role"}
        and all(isinstance(x, str) and x for x in v.values())
    )


# meta.json, as `Checkpointer.meta` writes it: key -> (required, check, what it must be).
_META: dict[str, tuple[bool, Any, str]] = {
    "format": (True, lambda v: type(v) is int and v == FORMAT, f"{FORMAT}"),
    "hybridflow": (False, lambda v: isinstance(v, str), "a version string"),
    "step": (True, lambda v: type(v) is int and v >= 1, "an integer >= 1 (steps done)"),
    "seed": (True, lambda v: type(v) is int, "an integer"),
    "policy_version": (True, _nonneg_int, "an integer >= 0"),
    "data": (
        False,
        lambda v: isinstance(v, dict) and all(_nonneg_int(x) for x in v.values()),
        "an object of integers >= 0 (next_step, samples_seen)",
    ),
    "actor": (True, _is_actor, 'null or {"stage": ..., "role": ...}'),
    "created": (
        False,
        lambda v: type(v) in (int, float) and math.isfinite(v),
        "a number (seconds since the epoch)",
    ),
    "config": (
        True,
        lambda v: isinstance(v, dict) and isinstance(v.get("stages"), dict),
        "the run's topology (an object with `stages`)",
    ),
    "extra": (False, lambda v: isinstance(v, dict), "an object"),
}


def read_meta(root: Path) -> dict[str, Any]:
    """meta.json of checkpoint `root`, parsed strictly (`_META`): a value of the wrong
    type, a missing or an unknown key is a ConfigError naming the file and the key."""
    path = Path(root) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError("resume_from", f"{path}: cannot be read: {exc}") from exc
    except ValueError as exc:
        raise ConfigError("resume_from", f"{path}: is not JSON: {exc}") from None
    if not isinstance(meta, dict) or not _META["format"][1](meta.get("format")):
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ConfigError(
            "resume_from",
            f"{path}: not a hybridflow checkpoint of format {FORMAT} ('format' is {got!r})",
        )
    for key in meta:
        if key not in _META:
            raise ConfigError(
                "resume_from", f"{path}: unknown key {key!r} (known: {', '.join(_META)})"
            )
    for key, (required, ok, what) in _META.items():
        if key not in meta:
            if required:
                raise ConfigError("resume_from", f"{path}: key {key!r} is missing ({what})")
        elif not ok(meta[key]):
            shown = repr(meta[key])
            shown = shown if len(shown) <= 80 else shown[:80] + "..."
            raise ConfigError("resume_from", f"{path}: {key!r} must be {what}, got {shown}")
    return meta

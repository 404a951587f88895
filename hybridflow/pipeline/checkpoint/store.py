"""Checkpoints: every stage's role states + RNG, the run's position and config, on disk.

Layout of one checkpoint (a directory, written atomically: built under a temporary name
in the same parent, then renamed; `latest` is replaced atomically after the rename):

    <save_dir>/step-00000006/
        meta.json                   format, step (= steps done = the next step to run),
                                    seed, policy version, data position, config (topology
                                    as plain data), created, extra (e.g. the builder's logic)
        stages/<stage>-<replica>/
            <role>.safetensors      every tensor of Role.state_dict() (weights, optimizer
                                    moments, generator states), keyed by dotted path
            <role>.json             the rest of the state, tensors replaced by
                                    {"__tensor__": key}; tuples/int keys/NaN tagged
            <role>.shards.json      (trainer roles) AdamW step counts + hyper-parameters
            rng.safetensors / rng.json   the process's torch (CPU, CUDA), Python and
                                    NumPy RNG states
        shards/<stage>.<role>/      (trainer roles: actor, critic) weights and AdamW
                                    moments through torch.distributed.checkpoint, one
                                    safetensors file per rank with the shard offsets in
                                    its header (stages/parallel/checkpoint.py): a
                                    checkpoint of N ranks loads on M ranks; a LoRA
                                    role's hold its adapters only (the base is
                                    rebuilt from the config: a rollout resuming
                                    gets base + merged adapters, `policy_weights`)
        policy/                     (final checkpoint) the actor's model + tokenizer via
                                    save_pretrained: transformers and vLLM load it as is
                                    (a LoRA actor: a PEFT adapter directory, and with
                                    lora_export_merged a save_pretrained `merged/`)
    <save_dir>/latest               the name of the newest complete checkpoint

The config, `CheckpointConfig` (save_dir, save_interval, keep_last, export_final), lives
in config/schema.py: a topology's `checkpoint:` section and the Python API's
`Engine.save_checkpoint` both make one.

Nothing is pickled: tensors go to safetensors, everything else to JSON, and loading
refuses any JSON node it does not recognise. Who calls what:
  - the coordinator (`Checkpointer`) decides when (`due`), creates the temporary
    directory, asks every stage process to write its part (`save_stage`, run inside the
    stage), then writes meta.json and commits (`commit`: rename, `latest`, prune to
    `keep_last`);
  - a stage process started with a checkpoint (`resume_dir`) calls `load_stage` after
    its roles' setup: each role gets its state back (a rank that the writing run did not
    have takes replica 0's JSON state and RNG: the rank count of a sharded stage may
    change between save and resume); a role that takes weights
    (`update_weights`: the rollout engines) gets the policy weights of the checkpoint's
    actor, so a resumed run generates with the trained policy from its first step.
Reading validates before it trusts (`resolve`, run before any stage starts, and the
stage-side readers again): `latest` must name a complete `step-*` directory of save_dir
itself; meta.json is parsed strictly (`_META`); every safetensors file's header and size
are checked (stages/parallel/checkpoint.py `check_file`) and every JSON state file parses.
Each refusal is one line, a ConfigError naming the file and the key. A damaged newest
checkpoint is refused, never silently replaced by an older one; only a save_dir without
any `latest` resumes its newest complete checkpoint, with a warning that says so.

Writing names what it could not write: a failed write is an OSError with the errno
(ENOSPC on a full disk) and the file's path; a failed commit leaves nothing temporary.

Invariant: a directory named step-* that exists is complete (partial ones keep their
temporary `.tmp-` name and are swept at the next save).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from hybridflow.config.schema import CheckpointConfig
from hybridflow.errors import ConfigError, PipelineError

log = logging.getLogger("hybridflow.checkpoint")

FORMAT = 1
_RANK_FILE = "shard-{:05d}-"  # DCP's HF storage names rank r's file shard-<r+1>-...
_PREFIX = "step-"
_TMP = ".tmp-"

# ---------------------------------------------------------------------------------------
# A state tree <-> (JSON-able tree, flat tensor dict)


def encode_tree(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """Replace tensors by {"__tensor__": key} (filling `tensors`); tag what JSON lacks."""
    if isinstance(obj, torch.Tensor):
        key = path or "tensor"
        while key in tensors:
            key += "_"
        # safetensors refuses shared storage and non-contiguous tensors: own copies.
        tensors[key] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_tree(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_tree(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        plain = all(isinstance(k, str) and not k.startswith("__") for k in obj)
        if plain:
            return {k: encode_tree(v, tensors, _join(path, k)) for k, v in obj.items()}
        return {
            "__items__": [
                [
                    encode_tree(k, tensors, f"{path}.key"),
                    encode_tree(v, tensors, _join(path, str(k))),
                ]
                for k, v in obj.items()
            ]
        }
    raise TypeError(f"cannot checkpoint a {type(obj).__name__} at {path or 'the top'}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def decode_tree(node: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    if isinstance(node, list):
        return [decode_tree(v, tensors, where) for v in node]
    if not isinstance(node, dict):
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise PipelineError(f"{where}: unexpected JSON value {node!r}")
    if len(node) == 1:
        ((tag, value),) = node.items()
        if tag == "__tensor__":
            if value not in tensors:
                raise PipelineError(
                    f"{where}: tensor {value!r} is missing from the safetensors file"
                )
            return tensors[value]
        if tag == "__float__":
            if value not in ("nan", "inf", "-inf"):
                raise PipelineError(f"{where}: bad float tag {value!r}")
            return float(value)
        if tag == "__tuple__":
            return tuple(decode_tree(v, tensors, where) for v in value)
        if tag == "__items__":
            return {
                decode_tree(k, tensors, where): decode_tree(v, tensors, where) for k, v in value
            }
    for key in node:
        if key.startswith("__"):
            raise PipelineError(f"{where}: unknown tag {key!r}")
    return {k: decode_tree(v, tensors, where) for k, v in node.items()}


def write_state(state: Any, directory: Path, name: str) -> None:
    """`<name>.json` + `<name>.safetensors` (the latter only if there are tensors).
    A failed write is an OSError naming the file (`_writing`)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    tree = encode_tree(state, tensors)
    if tensors:
        blob = directory / f"{name}.safetensors"
        with _writing(blob):
            save_file(tensors, str(blob))
    text = directory / f"{name}.json"
    with _writing(text):
        text.write_text(json.dumps(tree, allow_nan=False))


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Write errors as an OSError that names `path` and keeps the errno (ENOSPC on a full
    disk): a write() fails with no file name, and safetensors reports its I/O errors as
    text ("... (os error 28)"), so the caller would otherwise learn neither."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    except Exception as exc:
        if type(exc).__name__ != "SafetensorError":
            raise
        code = re.search(r"os error (\d+)", str(exc))
        if code is None:
            raise OSError(f"cannot write {path}: {exc}") from exc
        num = int(code.group(1))
        raise OSError(num, os.strerror(num), str(path)) from exc


def read_state(directory: Path, name: str) -> Any:
    """What `write_state` wrote; each file checked before it is trusted (`_read_json`,
    `check_file`): a damaged one is a ConfigError naming it."""
    from safetensors.torch import load_file

    from hybridflow.stages.parallel.checkpoint import check_file

    where = directory / f"{name}.json"
    tree = _read_json(where)
    blob = directory / f"{name}.safetensors"
    tensors = {}
    if blob.is_file():
        check_file(blob)
        tensors = load_file(str(blob))
    return decode_tree(tree, tensors, str(where))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: JSON, UTF-8
        raise ConfigError("resume_from", f"checkpoint file {path} is unreadable: {exc}") from exc


# ---------------------------------------------------------------------------------------
# Process RNG states


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = list(torch.cuda.get_rng_state_all())
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
    except ImportError:
        pass
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    cuda = state.get("torch_cuda")
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    np_state = state.get("numpy")
    if np_state:
        import numpy as np

        keys = np_state["keys"].numpy().astype("uint32")
        np.random.set_state(
            (np_state["kind"], keys, np_state["pos"], np_state["has_gauss"], np_state["gauss"])
        )


def derive_seed(seed: int, *parts: Any) -> int:
    """A stable 63-bit seed from the run seed and any parts (same in every process)."""
    import hashlib

    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_process(seed: int) -> None:
    """Seed every global RNG of a process (torch, CUDA, Python, NumPy) from one int."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (1 << 32))
    except ImportError:
        pass


# ---------------------------------------------------------------------------------------
# Inside a stage process


def stage_dir(root: Path, stage: str, replica: int) -> Path:
    return root / "stages" / f"{stage}-{replica}"


def shard_dir(root: Path, stage: str, role: str) -> Path:
    return root / "shards" / f"{stage}.{role}"


def _writes_shards(role: Any) -> bool:
    return bool(getattr(role, "writes_shards", False))


def save_stage(
    roles: Mapping[str, Any],
    kinds: Mapping[str, str],
    root: Path,
    stage: str,
    replica: int,
    export: str = "",
) -> dict[str, float]:
    """Write this process's part of a checkpoint under `root` (the temporary directory).
    `export`: a directory to write the actor's model with save_pretrained (replica 0)."""
    t0 = time.perf_counter()
    out = stage_dir(root, stage, replica)
    out.mkdir(parents=True, exist_ok=True)
    nbytes = 0
    for name, role in roles.items():
        if _writes_shards(role):  # collective over the role's ranks
            shards = shard_dir(root, stage, name)
            write_state(role.save_shards(shards), out, f"{name}.shards")
            nbytes += sum(
                f.stat().st_size for f in shards.glob(f"*{_RANK_FILE.format(replica + 1)}*")
            )
        write_state(role.state_dict(), out, name)
        blob = out / f"{name}.safetensors"
        nbytes += blob.stat().st_size if blob.is_file() else 0
    write_state(rng_state(), out, "rng")
    if export:
        for name, role in roles.items():
            if kinds.get(name) != "actor":
                continue
            if callable(getattr(role, "export_pretrained", None)):
                role.export_pretrained(Path(export), write=replica == 0)  # collective
            elif replica == 0:
                _export(role, Path(export))
    return {"checkpoint/save_s": time.perf_counter() - t0, "checkpoint/bytes": float(nbytes)}


def _export(role: Any, directory: Path) -> None:
    from hybridflow.models.loader import save_pretrained

    model, tokenizer = getattr(role, "model", None), getattr(role, "tokenizer", None)
    if model is None or tokenizer is None or not hasattr(model, "save_pretrained"):
        # e.g. the synthetic backend: there is no policy to export, only state.
        log.info(
            "actor backend %s has no transformers model: nothing exported", type(role).__name__
        )
        return
    save_pretrained(model, tokenizer, directory)


def load_stage(
    roles: Mapping[str, Any],
    kinds: Mapping[str, str],
    root: Path,
    stage: str,
    replica: int,
) -> None:
    """Restore this process's roles and RNG from checkpoint `root` (after role setup)."""
    src = stage_dir(root, stage, replica)
    if not src.is_dir() and replica > 0 and any(_writes_shards(r) for r in roles.values()):
        # A rank the writing run did not have (the stage's rank count changed): its
        # shards come from the shard files, the rest from replica 0.
        log.info(
            "%s/%d: not in checkpoint %s; resuming from replica 0's state", stage, replica, root
        )
        src = stage_dir(root, stage, 0)
    if not src.is_dir():
        raise PipelineError(
            f"checkpoint {root} has no state for stage {stage} replica {replica}; was it "
            "written by a run with the same stages and replicas?"
        )
    meta = read_meta(root)
    for name, role in roles.items():
        if not (src / f"{name}.json").is_file():
            raise PipelineError(f"checkpoint {root}: no state for role {name!r} in {src}")
        if _writes_shards(role):  # collective over the role's ranks
            shards = shard_dir(root, stage, name)
            if not shards.is_dir():
                raise PipelineError(
                    f"checkpoint {root}: no weight shards for role {name!r} ({shards})"
                )
            role.load_shards(shards, read_state(src, f"{name}.shards"))
        role.load_state_dict(read_state(src, name))
    for name, role in roles.items():
        if kinds.get(name) != "actor" and hasattr(role, "update_weights"):
            weights = policy_weights(root)
            role.update_weights(iter(weights.items()), version=int(meta["policy_version"]))
            log.info("%s: policy weights of step %d loaded", name, meta["step"])
    set_rng_state(read_state(src, "rng"))


def policy_weights(root: Path) -> dict[str, torch.Tensor]:
    """The actor's full model weights in checkpoint `root` (assembled from its shards)."""
    meta = read_meta(root)
    actor = meta.get("actor")
    if not actor:
        raise PipelineError(f"checkpoint {root} holds no actor (meta.json names none)")
    shards = shard_dir(root, actor["stage"], actor["role"])
    if shards.is_dir():
        from hybridflow.stages.parallel.checkpoint import read_full

        weights = read_full(shards, "model.")
        extra = read_state(stage_dir(root, actor["stage"], 0), f"{actor['role']}.shards")
        if not extra.get("lora"):
            return weights
        # A LoRA actor's shards hold its adapters only: the policy is its base with them
        # merged, rebuilt from the checkpoint's own config (models/lora.py).
        from hybridflow.models.lora import merged_policy

        where = f"stages.{actor['stage']}.roles.{actor['role']}.options"
        options = meta["config"]["stages"][actor["stage"]]["roles"][actor["role"]]["options"]
        return merged_policy(options, int(meta["seed"]), weights, where)
    # An actor backend without shards (e.g. synthetic) keeps its weights in its state.
    from safetensors.torch import load_file

    from hybridflow.stages.parallel.checkpoint import check_file

    blob = stage_dir(root, actor["stage"], 0) / f"{actor['role']}.safetensors"
    check_file(blob)
    tensors = load_file(str(blob))
    prefix = "model."
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


# ---------------------------------------------------------------------------------------
# In the coordinator


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
                if (rc.kind or role) == "actor"
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
        for stale in self.root.glob(f"{_TMP}*"):  # an earlier crash mid-save
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:  # a `latest` pointer that was never moved into place
                stale.unlink(missing_ok=True)
        tmp = self.root / f"{_TMP}{_PREFIX}{step + 1:08d}-{uuid.uuid4().hex[:6]}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, meta: dict[str, Any]) -> Path:
        """meta.json, rename to step-*, then `latest`. A failed write is an OSError naming
        the file it was for; nothing temporary stays behind (a partial checkpoint is
        removed: on a full disk its space is what the user needs back)."""
        try:
            with _writing(tmp / "meta.json"):
                (tmp / "meta.json").write_text(json.dumps(meta, indent=1, allow_nan=False))
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        final = self.root / f"{_PREFIX}{int(meta['step']):08d}"
        if final.exists():  # the same step saved again (a re-run): replace it whole
            trash = self.root / f"{_TMP}old-{uuid.uuid4().hex[:6]}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        # From here `final` is complete; `latest` names it once the pointer is in place.
        pointer = self.root / f"{_TMP}latest-{uuid.uuid4().hex[:6]}"
        try:
            with _writing(self.root / "latest"):
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


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root` (directories of it, not links), oldest first."""
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.glob(f"{_PREFIX}*")
        if p.is_dir() and not p.is_symlink() and (p / "meta.json").is_file()
    ]
    return sorted(found, key=lambda p: p.name)


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


_NAME = re.compile(rf"{_PREFIX}\d{{8}}")


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
            f"{root} ({_PREFIX}NNNNNNNN)" + _newest(root, ""),
        ) from None
    shown = repr(name if len(name) <= 80 else name[:80] + "...")
    if "/" in name or os.sep in name or name in (".", ".."):
        raise ConfigError(
            "resume_from",
            f"{pointer}: names {shown}, a path outside {root}; `latest` must name a "
            f"checkpoint directory inside its save_dir ({_PREFIX}NNNNNNNN)",
        )
    if not _NAME.fullmatch(name):
        raise ConfigError(
            "resume_from",
            f"{pointer}: names {shown}, which is not a checkpoint directory name "
            f"({_PREFIX}NNNNNNNN)" + _newest(root, name),
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
            _read_json(path)


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


def iter_stage_dirs(root: Path) -> Iterator[Path]:
    yield from sorted((root / "stages").glob("*-*"))

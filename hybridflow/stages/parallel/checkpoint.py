"""Sharded checkpoints of a trainer role with torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the weights and of the AdamW moments into one
directory, as safetensors files whose headers carry each shard's offsets (DCP's
HuggingFace storage: JSON metadata, nothing pickled, unlike DCP's default `.metadata`).
Loading reads whatever slices this rank's shards need, so a checkpoint written by N ranks
loads on M ranks, or into a plain unsharded model (M = 1 without a group). What is not a
tensor (AdamW's step counts and hyper-parameters) is returned to the caller, which stores
it in the role's JSON state.

Layout: <directory>/shard-<rank+1>-model-00001-of-00001.safetensors, keys
`model.<HF name>` and `optim.<HF name>.<exp_avg|exp_avg_sq>`. With `trainable_only`
(a LoRA role) `model.*` holds the adapters only; the frozen base is not written.

Invariants: save and load are collective over the role's group (every rank calls them);
resuming on the same number of ranks restores every tensor bit-exactly.

Errors: DCP wraps what failed in a `CheckpointException`, which derives from
BaseException (not Exception): it is translated here, in one place, into what the caller
can name. A failed write is an `OSError` naming the directory (a full disk: ENOSPC); a
file that cannot be trusted on load (truncated, a header that is no safetensors header,
offsets that do not fit the tensor) is a one-line `ConfigError` naming the file and the
tensor, found by `check_file` before DCP reads a byte.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hybridflow.errors import ConfigError

# safetensors dtype -> bytes per element (the dtypes a checkpoint of torch tensors holds)
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
_MAX_HEADER = 100 << 20  # bytes: safetensors' own limit for a header


@contextlib.contextmanager
def _quiet(alone: bool) -> Iterator[None]:
    """DCP warns on every single-process save/load that it assumes one process: that is
    the intent here (an unsharded trainer role), so the warning is dropped."""
    with warnings.catch_warnings():
        if alone:
            warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.untyped_storage().data_ptr())


def _options(trainable_only: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen weights (the base under LoRA adapters) are rebuilt from the role's `model`
    # options on resume: only what the optimizer changes is written. Their keys are then
    # absent on load by design, hence not strict.
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """-> (what DCP reads/writes, the optimizer state dict, tied name -> its first name)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # get_state_dict initialises missing optimizer state (zero-grad step, lr 0), so a
    # freshly set-up role has every moment to load into.
    msd, osd = get_state_dict(model, optimizer, options=_options(trainable_only))
    if trainable_only:
        # A frozen weight tied to another (the LM head to the embeddings) is a state-dict
        # key of no parameter of its own, which DCP's filter misses.
        trained = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        msd = {k: v for k, v in msd.items() if k in trained}
    # Tied weights (embedding = LM head) share storage, which safetensors refuses: store
    # the first name only and re-point the others at it on load.
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for key, t in msd.items():
        ptr = _storage(t)
        if ptr in first:
            tied[key] = first[ptr]
        else:
            first[ptr] = key
    weights = {k: v for k, v in msd.items() if k not in tied}
    moments = {
        fqn: {k: v for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor)}
        for fqn, state in osd["state"].items()
    }
    return {"model": weights, "optim": moments}, osd, tied


def save(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    directory: Path,
    *,
    alone: bool,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Write this rank's shards into `directory`; -> the non-tensor optimizer state.
    `trainable_only`: only the parameters that require grad (LoRA adapters)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    tensors, osd, _ = _tensors(model, optimizer, trainable_only)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with _quiet(alone):
            dcp.save(
                tensors,
                storage_writer=dcp.HuggingFaceStorageWriter(str(directory), save_distributed=True),
                no_dist=alone,  # no group: one process writes the lone shard
            )
    except CheckpointException as exc:  # a BaseException: named here (module docstring)
        raise _write_error(exc, directory) from exc
    steps = {fqn: float(s["step"]) for fqn, s in osd["state"].items() if "step" in s}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
    return {"steps": steps, "param_groups": groups}


def load(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    directory: Path,
    extra: dict[str, Any],
    *,
    alone: bool,
    trainable_only: bool = False,
) -> None:
    """Restore weights and moments from `directory` (any number of writer ranks) and the
    non-tensor state `extra` (what `save` returned)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    tensors, osd, tied = _tensors(model, optimizer, trainable_only)
    check_dir(directory)
    with _reading(directory), _quiet(alone):
        dcp.load(
            tensors, storage_reader=dcp.HuggingFaceStorageReader(str(directory)), no_dist=alone
        )
    steps = extra.get("steps", {})
    state = {
        fqn: {**moments, "step": torch.tensor(float(steps.get(fqn, 0.0)))}
        for fqn, moments in tensors["optim"].items()
    }
    groups = [
        {**mine, **{k: v for k, v in saved.items() if k in mine}}
        for mine, saved in zip(osd["param_groups"], extra.get("param_groups", []), strict=False)
    ] or osd["param_groups"]
    weights = dict(tensors["model"])
    weights.update({alias: weights[name] for alias, name in tied.items()})
    set_state_dict(
        model,
        optimizer,
        model_state_dict=weights,
        optim_state_dict={"state": state, "param_groups": groups},
        options=_options(trainable_only),
    )


def read_full(directory: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` as one full tensor (shards assembled), prefix removed:
    the policy weights a rollout loads on resume; no process group needed."""
    import torch.distributed.checkpoint as dcp

    check_dir(directory)
    with _reading(directory):
        meta = dcp.HuggingFaceStorageReader(str(directory)).read_metadata()
        out = {
            key: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for key, m in meta.state_dict_metadata.items()
            if key.startswith(prefix)
        }
        with _quiet(True):
            dcp.load(out, storage_reader=dcp.HuggingFaceStorageReader(str(directory)), no_dist=True)
    return {k[len(prefix) :]: v for k, v in out.items()}


# ---------------------------------------------------------------------------------------
# Errors, and the checks that run before a byte is trusted


def _cause(exc: BaseException) -> BaseException:
    """What failed inside DCP's CheckpointException (the first failing rank's own)."""
    failures = getattr(exc, "failures", None) or {}
    for _, (inner, _tb) in sorted(failures.items()):
        return inner
    return exc


def _write_error(exc: BaseException, directory: Path) -> Exception:
    cause = _cause(exc)
    if isinstance(cause, OSError) and cause.errno is not None:
        # OSError(errno, ...) keeps the kind (ENOSPC, EACCES, ...) and names the path.
        return OSError(cause.errno, f"{cause.strerror} (writing weight shards)", str(directory))
    return OSError(f"writing weight shards to {directory}: {type(cause).__name__}: {cause}")


@contextlib.contextmanager
def _reading(directory: Path) -> Iterator[None]:
    """DCP's read errors (a BaseException) as one line naming the directory."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        cause = _cause(exc)
        text = str(cause).strip().splitlines()[-1:] or [""]
        raise ConfigError(
            "resume_from",
            f"weight shards in {directory} cannot be loaded: {type(cause).__name__}: {text[0]}",
        ) from exc


def check_dir(directory: Path) -> None:
    """Every safetensors file of a shard directory passes `check_file` (and there is one)."""
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise ConfigError("resume_from", f"{directory}: no weight shard files (*.safetensors)")
    for path in files:
        check_file(path)


def check_file(path: Path) -> None:
    """A safetensors file that can be trusted: its 8-byte header length, a JSON header of
    tensors (dtype, shape, data_offsets) whose byte ranges fit their shapes, and a file
    size that is exactly where the last range ends. Otherwise a ConfigError naming the
    file and the key at fault.
    Reads the header only (a truncated multi-GB shard is found in microseconds)."""

    def bad(why: str) -> ConfigError:
        return ConfigError("resume_from", f"checkpoint file {path} {why}")

    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"is truncated: {size} bytes, less than its 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > min(size - 8, _MAX_HEADER):
                raise bad(f"is truncated or not safetensors: header of {n} bytes in {size}")
            header = json.loads(f.read(n))
    except ConfigError:  # one of ours (a ValueError too): as it is
        raise
    except OSError as exc:
        raise bad(f"cannot be read: {exc}") from exc
    except ValueError as exc:  # JSON or UTF-8
        raise bad(f"has a header that is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise bad("has a header that is not a JSON object")
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        end = max(end, _check_entry(key, info, bad))
    if 8 + n + end > size:
        last = max(
            (k for k in header if k != "__metadata__"),
            key=lambda k: header[k]["data_offsets"][1],
        )
        raise bad(
            f"is truncated: {size} bytes, its header needs {8 + n + end} "
            f"(tensor {last!r} ends past the end of the file)"
        )
    if 8 + n + end < size:
        raise bad(f"has {size - 8 - n - end} bytes that no tensor of its header covers")


def _check_entry(key: str, info: Any, bad: Any) -> int:
    """One header entry -> the end of its bytes; raises `bad(...)` naming `key`."""
    if not isinstance(info, dict):
        raise bad(f"has tensor {key!r} without a description")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        raise bad(f"has tensor {key!r} of unknown dtype {dtype!r}")
    ints = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
    pair = isinstance(offsets, list) and len(offsets) == 2
    if not ints or not pair or not all(type(o) is int and o >= 0 for o in offsets):
        raise bad(f"has tensor {key!r} with a bad shape {shape!r} or offsets {offsets!r}")
    begin, end = offsets
    want = _DTYPE_BYTES[dtype]
    for d in shape:
        want *= d
    if end - begin != want:
        raise bad(
            f"has tensor {key!r} ({dtype} {shape}) of {want} bytes whose offsets span {end - begin}"
        )
    return end

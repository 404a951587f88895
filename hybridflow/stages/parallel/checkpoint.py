"""Sharded checkpoints of a trainer role with torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the weights and of the AdamW moments into one
directory, as safetensors files whose headers carry each shard's offsets (DCP's
HuggingFace storage: JSON metadata, nothing pickled, unlike DCP's default `.metadata`).
Loading reads whatever slices this rank's shards need, so a checkpoint written by N ranks
loads on M ranks, or into a plain unsharded model (M = 1 without a group). What is not a
tensor (AdamW's step counts and hyper-parameters) is returned to the caller, which stores
it in the role's JSON state.

Layout: <directory>/shard-<rank+1>-model-00001-of-00001.safetensors, keys
`model.<HF name>` and `optim.<HF name>.<exp_avg|exp_avg_sq>`.

Invariants: save and load are collective over the role's group (every rank calls them);
resuming on the same number of ranks restores every tensor bit-exactly.

Errors: DCP wraps what failed in a `CheckpointException`, which derives from
BaseException (not Exception): it is translated here, in one place, into what the caller
can name. A failed write is an `OSError` naming the directory (a full disk: ENOSPC).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


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


def _tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """-> (what DCP reads/writes, the optimizer state dict, tied name -> its first name)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # get_state_dict initialises missing optimizer state (zero-grad step, lr 0), so a
    # freshly set-up role has every moment to load into.
    msd, osd = get_state_dict(model, optimizer)
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
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path, *, alone: bool
) -> dict[str, Any]:
    """Write this rank's shards into `directory`; -> the non-tensor optimizer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    tensors, osd, _ = _tensors(model, optimizer)
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
) -> None:
    """Restore weights and moments from `directory` (any number of writer ranks) and the
    non-tensor state `extra` (what `save` returned)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    tensors, osd, tied = _tensors(model, optimizer)
    reader = dcp.HuggingFaceStorageReader(str(directory))
    with _quiet(alone):
        dcp.load(tensors, storage_reader=reader, no_dist=alone)
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
    )


def read_full(directory: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` as one full tensor (shards assembled), prefix removed:
    the policy weights a rollout loads on resume; no process group needed."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.HuggingFaceStorageReader(str(directory))
    meta = reader.read_metadata()
    out = {
        key: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for key, m in meta.state_dict_metadata.items()
        if key.startswith(prefix)
    }
    with _quiet(True):
        dcp.load(out, storage_reader=dcp.HuggingFaceStorageReader(str(directory)), no_dist=True)
    return {k[len(prefix) :]: v for k, v in out.items()}


# ---------------------------------------------------------------------------------------
# Errors


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

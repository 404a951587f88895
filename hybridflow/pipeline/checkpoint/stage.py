"""A stage process's side of checkpoints: its RNGs, its part of a save, its restore.

  - at start-up the stage seeds every global RNG of its process from the run seed and
    its (stage, replica) (`seed_process(derive_seed(...))`): the same in every run;
  - at a save the coordinator asks every stage process to write its part (`save_stage`,
    run inside the stage, into the coordinator's temporary directory): each role's
    state, a trainer role's weight shards (collective over its ranks), the process RNG,
    and at the end the actor's exported policy;
  - a stage process started with a checkpoint (`resume_dir`) calls `load_stage` after
    its roles' setup: each role gets its state back (a rank that the writing run did not
    have takes replica 0's JSON state and RNG: the rank count of a sharded stage may
    change between save and resume); a role that takes weights (`update_weights`: the
    rollout engines) gets the policy weights of the checkpoint's actor
    (`policy_weights`), so a resumed run generates with the trained policy from its
    first step.
Where each part lies: layout.py; how a state becomes files: tree.py.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hybridflow.errors import PipelineError
from hybridflow.pipeline.checkpoint.layout import RANK_FILE, shard_dir, stage_dir
from hybridflow.pipeline.checkpoint.resume import read_meta
from hybridflow.pipeline.checkpoint.tree import read_state, write_state

log = logging.getLogger("hybridflow.checkpoint")

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
# A stage's roles


def save_stage(
    roles: Mapping[str, Any],
    root: Path,
    stage: str,
    replica: int,
    export: str = "",
) -> dict[str, float]:
    """Write this process's part of a checkpoint under `root` (the temporary directory).
    `export`: a directory to write the policy into with save_pretrained: the model of
    the role whose class `exports_policy` (the actor), written by replica 0."""
    t0 = time.perf_counter()
    out = stage_dir(root, stage, replica)
    out.mkdir(parents=True, exist_ok=True)
    nbytes = 0
    for name, role in roles.items():
        if role.writes_shards:  # collective over the role's ranks
            shards = shard_dir(root, stage, name)
            write_state(role.save_shards(shards), out, f"{name}.shards")
            nbytes += sum(
                f.stat().st_size for f in shards.glob(f"*{RANK_FILE.format(replica + 1)}*")
            )
        write_state(role.state_dict(), out, name)
        blob = out / f"{name}.safetensors"
        nbytes += blob.stat().st_size if blob.is_file() else 0
    write_state(rng_state(), out, "rng")
    if export:
        for role in roles.values():
            if type(role).exports_policy:
                role.export_pretrained(Path(export), write=replica == 0)  # collective
    return {"checkpoint/save_s": time.perf_counter() - t0, "checkpoint/bytes": float(nbytes)}


def load_stage(
    roles: Mapping[str, Any],
    root: Path,
    stage: str,
    replica: int,
) -> None:
    """Restore this process's roles and RNG from checkpoint `root` (after role setup)."""
    src = stage_dir(root, stage, replica)
    if not src.is_dir() and replica > 0 and any(r.writes_shards for r in roles.values()):
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
        if role.writes_shards:  # collective over the role's ranks
            shards = shard_dir(root, stage, name)
            if not shards.is_dir():
                raise PipelineError(
                    f"checkpoint {root}: no weight shards for role {name!r} ({shards})"
                )
            role.load_shards(shards, read_state(src, f"{name}.shards"))
        role.load_state_dict(read_state(src, name))
    for name, role in roles.items():
        if type(role).receives_weights:
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

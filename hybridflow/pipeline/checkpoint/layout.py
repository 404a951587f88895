"""Where a checkpoint's parts lie on disk: the directory layout, its names and paths.

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
        coordinator/driver-<op>.*   state of the driver ops that keep any
        policy/                     (final checkpoint) the actor's model + tokenizer via
                                    save_pretrained: transformers and vLLM load it as is
                                    (a LoRA actor: a PEFT adapter directory, and with
                                    lora_export_merged a save_pretrained `merged/`)
    <save_dir>/latest               the name of the newest complete checkpoint

Each `<name>.json` / `<name>.safetensors` pair is one state tree (tree.py). The config,
`CheckpointConfig` (save_dir, save_interval, keep_last, export_final), lives in
config/schema.py: a topology's `checkpoint:` section and the Python API's
`Engine.save_checkpoint` both make one.

Invariant: a directory named step-* that exists is complete (partial ones keep their
temporary `.tmp-` name and are swept at the next save: checkpointer.py).
"""

from __future__ import annotations

from pathlib import Path

FORMAT = 1  # meta.json's `format`: what this code writes and the only one it reads
RANK_FILE = "shard-{:05d}-"  # DCP's HF storage names rank r's file shard-<r+1>-...
PREFIX = "step-"  # a complete checkpoint: PREFIX + the steps done, 8 digits
TMP = ".tmp-"  # anything being written (a checkpoint, a `latest` pointer)


def stage_dir(root: Path, stage: str, replica: int) -> Path:
    return root / "stages" / f"{stage}-{replica}"


def shard_dir(root: Path, stage: str, role: str) -> Path:
    return root / "shards" / f"{stage}.{role}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root` (directories of it, not links), oldest first."""
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.glob(f"{PREFIX}*")
        if p.is_dir() and not p.is_symlink() and (p / "meta.json").is_file()
    ]
    return sorted(found, key=lambda p: p.name)

"""Engine over real stage processes on CPU: checkpoints, resume, reproducibility, export.

One uninterrupted 6-step GRPO run (with a KL loss to a reference) is the reference. A
second run with the same seed, SIGKILLed after its second checkpoint, must have logged
identical metrics so far; a fresh engine (as after a restart) resumes it from the
latest checkpoint and must log identical metrics for the remaining steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from engine_job import builder

from hybridflow import DataflowBuilder
from hybridflow.errors import ConfigError

# Wall-clock numbers differ run to run; everything else must not.
TIMING = ("timing/", "compute/", "perf/", "rollout/gen_s", "rollout/tokens_per_s", "reward/fn_s")
JOB = Path(__file__).with_name("engine_job.py")


def clean(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


@pytest.fixture(scope="module")
def reference(engine_reference):
    """6 uninterrupted steps (conftest.py: run once, shared with the lifetime tests):
    metrics and the final checkpoint."""
    rows, last, log_dir = engine_reference
    return clean(rows), last, log_dir


def _names_step(pointer: Path, step: int) -> bool:
    try:
        name = pointer.read_text().strip()
    except OSError:
        return False
    return name.startswith("step-") and int(name.split("-")[1]) >= step


def test_killed_run_resumes_identically_and_same_seed_repeats(reference, tmp_path):
    """A job SIGKILLed after its second checkpoint; a fresh engine resumes it from the
    latest checkpoint. Both parts must match the uninterrupted run step for step."""
    ref_rows, _, _ = reference
    ck, run_dir = tmp_path / "ck", tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(JOB), str(run_dir), str(ck), "6", "INFO"],
        start_new_session=True,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        # `latest` moves last (checkpointer.py: meta.json, rename, then the pointer): a
        # kill after the rename but before the pointer resumes from step 1, as it should,
        # and this test wants a resume from step 2 or later.
        while not _names_step(ck / "latest", 2):
            assert proc.poll() is None, "the job ended before its second checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 90 s"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # the coordinator dies; its stages follow it
    finally:
        err = proc.communicate(timeout=30)[1]
    done = sorted(p.name for p in ck.glob("step-*"))
    assert done and "step-00000006" not in done, done  # killed mid-run
    # log_level reaches every stage process; their lines carry stage/replica and step.
    assert "INFO [engine/0 step" in err and "INFO [reward/0 step" in err

    # Reproducibility: the killed run logged the same numbers as the reference so far.
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    killed = clean([json.loads(x) for x in lines])
    assert len(killed) >= 2 and killed == ref_rows[: len(killed)]

    check_checkpoint(ck / done[-1], int(done[-1].split("-")[1]))

    engine = builder().build(metrics_backend="null", log_dir=tmp_path / "resumed")
    engine.save_checkpoint(ck, save_interval=0, keep_last=2)
    engine.resume("latest")
    start = engine.step
    assert 2 <= start < 6
    result = engine.train("last_digit", steps=6 - start)
    assert [r["step"] for r in result.metrics] == list(range(start, 6))
    assert clean(result.metrics) == ref_rows[start:]
    # keep_last=2 pruned the older checkpoints; `latest` names the newest
    assert sorted(p.name for p in ck.glob("step-*")) == [done[-1], "step-00000006"]
    assert (ck / "latest").read_text().strip() == "step-00000006"
    assert not list(ck.glob(".tmp-*"))
    # As in the issue: save_checkpoint after training also saves the current state now.
    saved = engine.save_checkpoint(save_path=tmp_path / "saved", save_interval=1000, keep_last=3)
    assert saved is not None and json.loads((Path(saved) / "meta.json").read_text())["step"] == 6
    assert (tmp_path / "saved" / "latest").read_text().strip() == Path(saved).name
    engine.close()


def check_checkpoint(path: Path, step: int) -> None:
    """Contents of one checkpoint: meta, role states (safetensors + JSON), RNG."""
    from safetensors.torch import load_file

    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == step and meta["seed"] == 3 and meta["policy_version"] == step
    assert meta["data"] == {"next_step": step, "samples_seen": 16 * step}
    assert meta["config"]["name"] == "resume" and "grpo_loss" in meta["extra"]["logic"]
    stage = path / "stages" / "engine-0"
    actor = load_file(str(stage / "actor.safetensors"))
    assert "trainer.generator" in actor  # the trainer's RNG
    # Weights and AdamW moments: DCP shards (one file for one rank), plain safetensors.
    (shard,) = (path / "shards" / "engine.actor").glob("*.safetensors")
    tensors = load_file(str(shard))
    assert any(k.startswith("model.model.") for k in tensors)
    assert any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in tensors)
    steps = json.loads((stage / "actor.shards.json").read_text())["steps"]
    assert set(steps.values()) == {float(step)}
    state = json.loads((stage / "actor.json").read_text())
    assert state["version"] == step and state["trainer"]["scheduler"]["last_epoch"] == step
    for proc in ("engine-0", "reward-0"):
        assert (path / "stages" / proc / "rng.safetensors").is_file()


def test_final_policy_is_exported_for_transformers(reference, tmp_path):
    _, last, _ = reference
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    policy = last / "policy"
    model = AutoModelForCausalLM.from_pretrained(str(policy), local_files_only=True)
    tok = PreTrainedTokenizerFast.from_pretrained(str(policy), local_files_only=True)

    from hybridflow.pipeline.checkpoint.stage import policy_weights

    trained = policy_weights(last)  # assembled from the actor's shards
    exported = model.state_dict()
    # Every exported tensor is compared (a name the checkpoint spelled differently would
    # otherwise be skipped in silence); the tied LM head is stored once, as the embedding.
    assert sorted(set(exported) - set(trained)) == ["lm_head.weight"], sorted(trained)[:5]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, value in exported.items():
        if name in trained:
            assert torch.equal(value, trained[name]), name
    assert tok("last:123=")["input_ids"]


def test_resume_errors_are_clear(reference, tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint under"):
        builder().build(metrics_backend="null", log_dir=tmp_path).resume("latest")
    with pytest.raises(ConfigError, match="is not a checkpoint"):
        builder().build(metrics_backend="null", log_dir=tmp_path).resume(tmp_path / "nothing")
    df = DataflowBuilder("other", seed=3)
    df.add_actor("tiny", device_mapping="cpu")
    df.add_reward_function("hybridflow.data.tasks:last_digit_reward")
    df.define_training_step(
        ["prompt"],
        ["loss"],
        "r = actor.generate(prompt, n=2)\ns = reward.score(r)\nloss = grpo_loss(s)\nactor.update(loss)",
    )
    _, last, _ = reference
    with pytest.raises(ConfigError, match="was written by stages"):
        df.build(metrics_backend="null", log_dir=tmp_path).resume(last)

"""An Engine keeps its stage processes between calls (real processes, tiny models, CPU).

Two `train` calls run on the same processes and the second continues the first exactly
(as one uninterrupted call would); `run` after `train` is one more step from the trained
policy (the same outputs as processes restored from the checkpoint); `close()`, a `with` block
and a forgotten Engine leave no process, shared memory or ipc directory; a stage that
dies between calls is a named error at the next call, which then restarts cleanly.

A start of the processes is most of a test's time here (each imports torch and
transformers and loads its models), so the life-cycle checks after the first test run
on one Engine, call after call, and the uninterrupted run to compare with is the one
test_api_engine.py compares with (conftest.py: `engine_reference`, run once).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from engine_job import builder

from hybridflow.errors import StageDeadError

TIMING = ("timing/", "compute/", "perf/", "rollout/gen_s", "rollout/tokens_per_s", "reward/fn_s")
PROMPTS = ["last:123=", "last:4567=", "last:98="]


def _helpers():
    path = Path(__file__).resolve().parents[1] / "pipeline" / "pipeline_helpers.py"
    spec = importlib.util.spec_from_file_location("api_pipeline_helpers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


leftovers = _helpers().leftovers


def clean(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def test_calls_reuse_processes_continue_training_and_run_samples_the_trained_policy(
    tmp_path, engine_reference
):
    with builder().build(metrics_backend="null", log_dir=tmp_path / "a") as engine:
        assert engine.pids() == {}  # nothing starts before the first call
        first = engine.train("last_digit", steps=1)
        pids, run_id = engine.pids(), engine.run_id
        assert set(pids) == {"engine/0", "reward/0"}
        second = engine.train("last_digit", steps=1)
        assert engine.pids() == pids  # same processes, models loaded once
        rows = first.metrics + second.metrics
        assert [r["step"] for r in rows] == [0, 1]
        assert [r["actor/policy_version"] for r in rows] == [1.0, 2.0]
        # The state after the two train calls, kept (the default keeps the last only).
        state = engine.save_checkpoint(tmp_path / "kept", keep_last=3)
        generated = engine.run(PROMPTS)  # the logic updates the actor: one more step
        assert engine.pids() == pids and engine.step == 3
    assert run_id is not None and leftovers(run_id, pids) == []
    assert engine.pids() == {}

    # One uninterrupted call logs what the two calls logged (its first two steps).
    uninterrupted, _, _ = engine_reference
    assert clean(uninterrupted[:2]) == clean(rows)

    # Processes restored from the checkpoint of the two calls compute what `run` computed
    # on the processes that trained: it started from the trained weights.
    with builder().build(metrics_backend="null", log_dir=tmp_path / "c") as restored:
        restored.resume(state)
        again = restored.run(PROMPTS)
    assert list(generated) == ["loss", "kl_div", "rewards"]  # the declared outputs
    assert generated["rewards"].shape == (len(PROMPTS), 4)  # n = 4 samples per prompt
    for name, value in generated.items():
        assert torch.equal(again[name], value), name


@pytest.mark.timeout(300)  # three starts of the processes (120 s is the default per test)
def test_close_restart_a_dead_stage_and_a_dropped_engine_leave_nothing(tmp_path):
    """One Engine through its life: `close()` (twice) leaves nothing and is not the end
    (the next call starts processes again from the state the first left); a stage that
    dies between calls is a named error at the next call, which stops the processes, and
    the call after restarts cleanly from the last checkpoint; an Engine dropped without
    `close()` (its processes up) leaves no process behind once collected."""
    engine = builder().build(metrics_backend="null", log_dir=tmp_path)
    engine.train("last_digit", steps=1)
    pids, run_id = engine.pids(), engine.run_id
    engine.close()
    engine.close()  # idempotent
    assert engine.pids() == {} and leftovers(run_id, pids) == []
    # A later call starts processes again, from the state the first call left.
    again = engine.train("last_digit", steps=1)
    assert [r["step"] for r in again.metrics] == [1]
    assert again.metrics[0]["actor/policy_version"] == 2.0
    pids2, run_id2 = engine.pids(), engine.run_id
    assert set(pids2.values()).isdisjoint(pids.values())

    # A stage dies between calls: the next call names it and stops the others.
    os.kill(pids2["reward/0"], signal.SIGKILL)
    time.sleep(0.3)
    t0 = time.monotonic()
    with pytest.raises(StageDeadError, match=r"stage reward replica 0 \(pid \d+\) was killed"):
        engine.train("last_digit", steps=1)
    assert time.monotonic() - t0 < 30  # no hang
    assert engine.step == 2 and engine.pids() == {}  # unchanged; processes stopped
    assert leftovers(run_id2, pids2) == []
    resumed = engine.train("last_digit", steps=1)  # restarts from the last checkpoint
    assert [r["step"] for r in resumed.metrics] == [2]
    assert resumed.metrics[0]["actor/policy_version"] == 3.0

    # Dropped without close(), its processes up: the finalizer stops them.
    pids3, run_id3 = engine.pids(), engine.run_id
    assert all(os.path.exists(f"/proc/{pid}") for pid in pids3.values())
    del engine
    gc.collect()
    assert leftovers(run_id3, pids3) == []

"""A GRPO run whose actor is one model sharded over two CPU ranks (FSDP2 over gloo).

`stages.engine.replicas: 2` makes the hybrid engine two processes: the actor's two
replicas are the ranks of one sharded model (every actor task goes to both, each with
half the rows), while rollout and reference stay two independent copies that share the
micro-batches. The run must learn the built-in task, write its weights as two shards,
and its checkpoint must resume on one rank.
"""

from __future__ import annotations

from e2e_helpers import mean, preset, read_jsonl

from hybridflow.pipeline.runtime.runner import resume_point, run_topology

STEPS = 14


def _grpo(run_dir, *extra):
    return preset(
        "grpo",
        run_dir,
        f"run.steps={STEPS}",
        "run.step_batch=64",
        "run.micro_batch=32",
        "metrics.backends=[jsonl]",
        "stages.engine.roles.actor.options.lr=0.01",
        "checkpoint.save_interval=7",
        *extra,
    )


def test_two_rank_grpo_learns_and_resumes_on_one_rank(tmp_path):
    run_dir = tmp_path / "fsdp2"
    run_topology(_grpo(run_dir, "stages.engine.replicas=2"))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    first, last = mean(rows[:3], "reward/mean"), mean(rows[-3:], "reward/mean")
    history = [round(r["reward/mean"], 3) for r in rows]
    assert first < 0.15 and last > 2 * first + 0.1, history
    # Counters are the group's, not summed over ranks: one update per step.
    assert all(r["actor/updates"] == 1.0 for r in rows)
    final = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    shards = sorted(p.name for p in (final / "shards" / "engine.actor").glob("*.safetensors"))
    assert len(shards) == 2, shards  # one file per rank
    assert (final / "policy" / "config.json").is_file()  # gathered, exported by rank 0

    # The same checkpoint resumes on one rank (the weights reassembled from the shards).
    more = _grpo(run_dir, f"run.steps={STEPS + 2}", "checkpoint=null")
    path, step = resume_point(more, str(final))
    assert step == STEPS
    run_topology(more, start_step=step, resume_dir=path)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows][-2:] == [STEPS, STEPS + 1]
    assert mean(rows[-2:], "reward/mean") > 2 * first + 0.1

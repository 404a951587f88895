"""Build once (issue 26 item 6): a run builds its data source once, and so tokenizes
every prompt once; a run cut into jobs at the validation points shares that source and
does not plan again; the validation set is read once; `hybridflow validate` plans once;
an Engine call builds its source once too.

Counted where it happens: the data source classes' own `__init__` and `close`, and the
`build_plan` the runtime's modules call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hybridflow import DataflowBuilder
from hybridflow.cli import main
from hybridflow.config.loader import config_hash
from hybridflow.config.schema import load_topology
from hybridflow.pipeline.api import engine as engine_module
from hybridflow.pipeline.plan.planner import build_plan
from hybridflow.pipeline.runtime import runner
from hybridflow.pipeline.runtime.coordinator import RunResult
from hybridflow.pipeline.runtime.jobs import validation
from hybridflow.pipeline.runtime.jobs.training import run_training
from hybridflow.pipeline.runtime.jobs.validation import Validator
from hybridflow.pipeline.runtime.runner import run_topology
from hybridflow.pipeline.sources.registry import SyntheticPrompts
from hybridflow.pipeline.sources.rl import GroupedPrompts

VALIDATED = ["validation.source=task:last_digit", "validation.max_prompts=8"]


def _count(monkeypatch: pytest.MonkeyPatch, cls: type) -> tuple[list[Any], list[Any]]:
    """-> (instances of `cls` built, instances closed), from now on."""
    made: list[Any] = []
    closed: list[Any] = []
    init, close = cls.__init__, cls.close

    def counted_init(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(self)
        init(self, *args, **kwargs)

    def counted_close(self: Any) -> None:
        closed.append(self)
        close(self)

    monkeypatch.setattr(cls, "__init__", counted_init)
    monkeypatch.setattr(cls, "close", counted_close)
    return made, closed


def _result(steps: range) -> RunResult:
    return RunResult(
        run_id="r",
        metrics=[{"step": float(s)} for s in steps],
        events=[],
        collected={},
        startup_s=0.0,
        wall_s=0.0,
        coordinator_cpu_s=0.0,
        tasks=0,
    )


class _Session:
    """Records the jobs run on it (a session's seam: `run_job`)."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Any, dict[str, Any]]] = []

    def run_job(self, plan: Any, **kw: Any) -> RunResult:
        self.jobs.append((plan, kw))
        return _result(range(kw["start_step"], plan.topology.run.steps))


class _Validator:
    """Validates at steps 1 and 2 (the interface run_training uses)."""

    def __init__(self) -> None:
        self.sample_rows: list[Any] = []
        self.tokenizer = None

    def points(self, start: int, end: int) -> list[int]:
        return [1, 2]

    def begin(self, start_step: int) -> None:
        pass

    def run(self, session: Any, step: int, samples: int = 0) -> tuple[dict[str, float], Any]:
        return {"val/reward/mean": 1.0}, _result(range(0))


@pytest.mark.slow
def test_a_run_builds_its_data_source_once(topo_dict, monkeypatch):
    made, closed = _count(monkeypatch, SyntheticPrompts)
    result = run_topology(load_topology(topo_dict(steps=2)))
    assert [m["step"] for m in result.metrics] == [0.0, 1.0]
    assert len(made) == 1, f"the data source was built {len(made)} times"
    assert closed == made


def test_training_cut_at_validation_points_shares_one_source_and_does_not_plan_again(
    topo_dict, monkeypatch
):
    plan = build_plan(load_topology(topo_dict(steps=3)))
    made, closed = _count(monkeypatch, SyntheticPrompts)  # a plan built now would count
    session = _Session()
    res = run_training(session, plan, start_step=0, sinks=[], validator=_Validator())

    assert [(p.topology.run.steps, kw["start_step"]) for p, kw in session.jobs] == [
        (1, 0),
        (2, 1),
        (3, 2),
    ]
    assert len(made) == 1 and closed == made  # built for the run, closed at its end
    assert all(kw["source"] is made[0] for _, kw in session.jobs)
    assert [r["step"] for r in res.validation] == [1.0, 2.0]
    # A chunk is the run's plan ending earlier: same ops and processes, its own hash.
    first = session.jobs[0][0]
    assert first.ops == plan.ops and first.processes == plan.processes
    assert first.config_hash == config_hash(first.topology) != plan.config_hash


def test_training_uses_the_source_it_is_given_and_leaves_it_open(topo_dict, monkeypatch):
    plan = build_plan(load_topology(topo_dict(steps=3)))
    given = SyntheticPrompts(("sample_idx", "prompt_ids"), {}, 0)
    made, closed = _count(monkeypatch, SyntheticPrompts)
    session = _Session()
    run_training(session, plan, start_step=0, sinks=[], validator=_Validator(), source=given)
    assert made == [] and closed == []  # the caller's to close
    assert all(kw["source"] is given for _, kw in session.jobs)


def test_the_validation_set_is_read_once(tmp_path: Path, monkeypatch):
    topo = load_topology("grpo", VALIDATED)
    made, closed = _count(monkeypatch, GroupedPrompts)
    validator = Validator(topo, tmp_path)
    try:
        assert len(made) == 1, f"the validation set was read {len(made)} times"
        assert validator.plan.topology.name == "grpo-val" and validator.prompts == 8
    finally:
        validator.close()
    assert closed == made


def test_validate_plans_once_and_reads_each_set_once(monkeypatch, capsys):
    planned: list[str] = []

    def counted(topo: Any, **kw: Any) -> Any:
        planned.append(topo.name)
        return build_plan(topo, **kw)

    monkeypatch.setattr(runner, "build_plan", counted)
    monkeypatch.setattr(validation, "build_plan", counted)
    made, _ = _count(monkeypatch, GroupedPrompts)
    args = [a for o in VALIDATED for a in ("--set", o)]
    assert main(["validate", "grpo", *args]) == 0
    assert capsys.readouterr().out.rstrip().endswith("ok")
    assert planned == ["grpo", "grpo-val"]  # the run's plan and the validation job's
    assert len(made) == 2  # the training set, the validation set: once each


ENGINE_LOGIC = """
response = actor.generate(prompt, n=2)
reward_score = reward.score(prompt, response)
loss = grpo_loss(reward_score)
actor.update(loss)
"""


def test_an_engine_call_builds_its_data_source_once(tmp_path: Path, monkeypatch):
    """Engine.train and Engine.run plan without a data check and hand the source they
    build to the job, as run_topology does (runner.plan_run). The session's seam
    (`run_job`) is faked, so no process starts."""
    df = DataflowBuilder("once", seed=1)
    df.add_actor("tiny", device_mapping="cpu", max_new_tokens=2)
    df.add_reward_function("hybridflow.data.tasks:last_digit_reward")
    df.define_training_step(["prompt"], ["loss", "rewards"], ENGINE_LOGIC)
    df.configure(step_batch=4, micro_batch=4)
    engine = df.build(metrics_backend="null", log_dir=tmp_path / "run")
    session = _Session()
    monkeypatch.setattr(engine, "_session_for", lambda plan, launch: session)
    monkeypatch.setattr(engine_module, "run_outputs", lambda *a: {})  # the fake has none
    made, closed = _count(monkeypatch, GroupedPrompts)

    engine.train(steps=1)
    assert len(made) == 1, f"train built the data source {len(made)} times"
    assert session.jobs[-1][1]["source"] is made[0] and closed == made

    made.clear()
    closed.clear()
    engine.run(["a prompt", "another"])
    assert len(made) == 1, f"run built the data source {len(made)} times"
    assert session.jobs[-1][1]["source"] is made[0] and closed == made

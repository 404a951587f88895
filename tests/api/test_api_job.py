"""The Engine runs a Job of plain data (pipeline/api/job.py), not the builder: build()
freezes the declarations, a builder changed afterwards changes no engine, and after SFT
the engine's own job (`with_policy`) moves every role built from the actor's model to
the fine-tuned policy. No processes here (build() starts none)."""

from __future__ import annotations

import dataclasses

from hybridflow import DataflowBuilder
from hybridflow.pipeline.api.job import Job

LOGIC = """
response = actor.generate(prompt, n=2)
reward_score = reward.score(prompt, response)
loss = grpo_loss(reward_score)
actor.update(loss)
"""


def _builder() -> DataflowBuilder:
    df = DataflowBuilder("job", seed=1)
    df.add_actor("tiny", device_mapping="cpu", model_overrides={"num_hidden_layers": 1})
    df.add_reference_model("tiny")
    df.add_reward_function("hybridflow.data.tasks:last_digit_reward")
    df.define_training_step(["prompt"], ["loss"], LOGIC)
    df.configure(step_batch=4, micro_batch=2)
    return df


def test_the_engine_runs_a_frozen_job_of_the_declarations(tmp_path):
    df = _builder()
    engine = df.build(metrics_backend="null", log_dir=tmp_path)
    job = engine.job
    assert isinstance(job, Job) and not hasattr(engine, "builder")
    assert job.topology == df.topology(**engine.settings)
    df.configure(step_batch=8)
    df.set_data("task:other")
    assert engine.job is job and job.topology.run.step_batch == 4
    assert dataclasses.is_dataclass(job) and job.extra()["logic"] == LOGIC


def test_with_policy_moves_the_actor_s_model_everywhere_and_leaves_the_builder(tmp_path):
    df = _builder()
    job = df.build(metrics_backend="null", log_dir=tmp_path).job
    after = job.with_policy(str(tmp_path / "policy"))
    roles = {r: rc.options for cfg in after.topology.stages.values() for r, rc in cfg.roles.items()}
    for role in ("actor", "rollout", "reference"):
        assert roles[role]["model"] == str(tmp_path / "policy"), role
        assert "model_overrides" not in roles[role], role
    assert job.declared.actor_options["model"] == "tiny"  # the old job is unchanged
    assert df.actor_options()["model"] == "tiny"


def test_the_engine_module_does_not_import_the_builder():
    from test_import_cycles import import_graph

    graph = import_graph()
    for module in ("engine", "job", "declared", "results"):
        deps = graph[f"hybridflow.pipeline.api.{module}"]
        assert "hybridflow.pipeline.api.builder" not in deps, module

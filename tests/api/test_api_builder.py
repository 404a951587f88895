"""DataflowBuilder as written in the issue, device mappings -> processes, to_yaml round
trip, and the errors build() raises before any process starts. No processes here."""

from __future__ import annotations

import inspect

import pytest

from hybridflow import DataflowBuilder, Engine
from hybridflow.config.loader import to_dict
from hybridflow.config.schema import load_topology
from hybridflow.errors import CompileError, ConfigError
from hybridflow.pipeline.api.declared import training_topology
from hybridflow.pipeline.api.placement import normalize, place
from hybridflow.pipeline.plan.planner import build_plan, describe

SEED = """
response = actor.generate(prompt)
reward_score = reward.score(prompt, response)
ref_logprob = ref.get_logprob(prompt, response)
actor_logprob = actor.get_logprob(prompt, response)
kl_div = actor_logprob - ref_logprob
loss = ppo_loss(reward_score, kl_div)
actor.update(loss)
"""


def issue_builder(actor="cpu", critic="cpu", reward="cpu:1", ref="cpu") -> DataflowBuilder:
    """The issue's code block, with CPU mappings (and a reward model preset)."""
    df = DataflowBuilder()
    df.add_actor(model_name="tiny", device_mapping={"actor": actor}, use_vllm=False)
    df.add_critic(model_name="tiny", device_mapping={"critic": critic})
    df.add_reward_model(model_name="tiny", device_mapping={"reward": reward})
    df.add_reference_model(model_name="tiny", device_mapping={"ref": ref})
    df.define_training_step(inputs=["prompt"], outputs=["loss", "kl_div", "rewards"], logic=SEED)
    return df


def test_issue_code_block_builds_an_engine_with_colocated_and_separate_processes(tmp_path):
    df = issue_builder()
    engine = df.build(log_level="INFO", metrics_backend="tensorboard", log_dir=tmp_path / "run1")
    assert isinstance(engine, Engine)
    topo = df.topology(**engine.settings)
    # identical mappings -> one process (hybrid engine); disjoint -> its own process
    assert {s: sorted(c.roles) for s, c in topo.stages.items()} == {
        "engine": ["actor", "critic", "reference", "rollout"],
        "reward": ["reward"],
    }
    assert topo.stages["reward"].roles["reward"].backend == "model"
    assert topo.log_level == "INFO" and topo.metrics.backends == ("tensorboard",)
    assert topo.run_dir == str(tmp_path / "run1")
    plan = build_plan(topo)
    assert [p.name for p in plan.processes] == ["engine/0", "reward/0"]


def test_gpu_mappings_fail_at_build_without_gpus_and_overrides_fix_them(tmp_path):
    df = issue_builder(actor="cuda:0", critic="cuda:0", reward="cuda:1", ref="cuda:0")
    with pytest.raises(
        ConfigError, match=r"device_mapping.actor: cuda:0 is not available: this machine has 0"
    ):
        df.build(log_dir=tmp_path, device_mapping=None)
    over = {"actor": "cpu", "critic": "cpu", "ref": "cpu", "reward": "cpu:1"}
    engine = df.build(log_dir=tmp_path, device_mapping=over)
    assert sorted(df.topology(**engine.settings).stages) == ["engine", "reward"]


def test_placement_rules():
    def slots(**m):
        return {role: normalize(role, v) for role, v in m.items()}

    # data-parallel ranks -> replicas; identical lists colocate
    out = place(
        slots(actor=["cuda:0", "cuda:1"], reference=["cuda:0", "cuda:1"], reward="cuda:2"),
        cuda_count=3,
    )
    assert [(s.name, s.roles, s.replicas, s.devices) for s in out] == [
        ("actor", ("actor", "reference"), 2, ["cuda:0", "cuda:1"]),
        ("reward", ("reward",), 1, "cuda:2"),
    ]
    # CPU slots: same device, separate processes; the CPU is shared freely
    out = place(slots(actor="cpu", critic="cpu:1", reward=["cpu", "cpu"]), cuda_count=0)
    assert [(s.roles, s.replicas, s.devices) for s in out] == [
        (("actor",), 1, "cpu"),
        (("critic",), 1, "cpu"),
        (("reward",), 2, "cpu"),
    ]
    with pytest.raises(ConfigError, match="share cuda:1 without being identical"):
        place(slots(actor=["cuda:0", "cuda:1"], critic="cuda:1"), cuda_count=2)
    with pytest.raises(ConfigError, match="cuda:3 is not available: this machine has 2"):
        place(slots(actor="cuda:3"), cuda_count=2)
    with pytest.raises(ConfigError, match="needs a multi-host launcher"):
        place(slots(actor=[("node0", "cuda:0"), ("node1", "cuda:0")]), cuda_count=1)
    ok = place(
        slots(actor=[("node0", "cuda:0"), ("node1", "cuda:0")]), cuda_count=1, multi_host=True
    )
    assert ok[0].replicas == 2
    assert normalize("actor", [("localhost", "cpu")])[0].node == ""  # this host
    with pytest.raises(ConfigError, match=r"device_mapping.actor\[1\]: cuda:0 is listed twice"):
        normalize("actor", ["cuda:0", "cuda:0"])
    with pytest.raises(ConfigError, match="is not a device"):
        normalize("actor", "gpu0")
    with pytest.raises(ConfigError, match="expected a device string or a"):
        normalize("actor", [3])


def test_to_yaml_round_trip_builds_the_same_plan(tmp_path):
    df = issue_builder()
    df.configure(step_batch=16, micro_batch=8)
    path = tmp_path / "job.yaml"
    text = df.to_yaml(path, steps=5, log_dir=tmp_path / "run")
    assert (
        text.startswith("# hybridflow topology")
        and "#   kl_div = actor_logprob - ref_logprob" in text
    )
    loaded = load_topology(path)
    built = df.topology(steps=5, log_dir=tmp_path / "run")
    assert loaded == built
    a, b = build_plan(loaded), build_plan(built)
    assert a.config_hash == b.config_hash and describe(a) == describe(b)


def test_topology_takes_and_shows_training_topologys_settings(tmp_path):
    """The settings are written once (declared.training_topology); the builder forwards
    them, and its signature (help(), the API reference) is theirs."""
    shown = inspect.signature(DataflowBuilder.topology).parameters
    theirs = inspect.signature(training_topology).parameters
    assert list(shown) == ["self", *(k for k, p in theirs.items() if p.kind is p.KEYWORD_ONLY)]
    assert all(shown[k].default == theirs[k].default for k in list(shown)[1:])
    df = issue_builder()
    assert df.topology(steps=3, log_dir=tmp_path).run.steps == 3
    with pytest.raises(TypeError, match="stepz"):
        df.topology(stepz=3)


def test_builder_topologies_equal_the_bundled_presets():
    """The presets written with the API: same dataflow, data and stages."""
    ppo = DataflowBuilder("ppo")
    ppo.add_actor(
        "tiny",
        device_mapping="cpu",
        lr=3e-3,
        grad_clip=1.0,
        clip_ratio_low=0.2,
        ppo_epochs=1,
        max_new_tokens=2,
        temperature=1.0,
    )
    ppo.add_critic("tiny", lr=3e-3, cliprange_value=0.5, grad_clip=1.0)
    ppo.add_reward_function("hybridflow.data.tasks:last_digit_reward")
    ppo.add_reference_model("tiny")
    # The preset sets GAE's lam to 0.95 (the default is verl's 1.0): the logic says so too.
    logic = SEED.replace(
        "ppo_loss(reward_score, kl_div)", "ppo_loss(reward_score, kl_div, lam=0.95)"
    )
    ppo.define_training_step(inputs=["prompt"], outputs=["loss", "kl_div", "rewards"], logic=logic)
    preset = load_topology("ppo")
    ppo.configure(step_batch=preset.run.step_batch, micro_batch=preset.run.micro_batch)
    ppo.set_data("last_digit", task_size=preset.data.options["task_size"])
    topo = ppo.topology(steps=preset.run.steps)
    assert topo.dataflow == preset.dataflow
    assert topo.data == preset.data
    assert {s: sorted(c.roles) for s, c in topo.stages.items()} == {
        s: sorted(c.roles) for s, c in preset.stages.items()
    }
    for stage, cfg in preset.stages.items():
        for role, rc in cfg.roles.items():
            mine = topo.stages[stage].roles[role]
            assert mine.backend == rc.backend
            # everything the preset sets is set the same way (defaults aside)
            extra = {k: v for k, v in mine.options.items() if k not in rc.options}
            assert {k: mine.options.get(k) for k in rc.options} == rc.options, (stage, role)
            assert set(extra) <= {"temperature"}, extra


def test_build_errors_are_clear():
    df = DataflowBuilder()
    with pytest.raises(ConfigError, match="a job needs an actor"):
        df.topology()
    df.add_actor("tiny")
    with pytest.raises(ConfigError, match="actor was already added"):
        df.add_actor("tiny")
    with pytest.raises(ConfigError, match=r"device_mapping\.critic: not a role of this call"):
        DataflowBuilder().add_reference_model("tiny", device_mapping={"critic": "cpu"})
    with pytest.raises(ConfigError, match=r"package\.module:function"):
        df.add_reward_function("not_a_function")
    with pytest.raises(ConfigError, match="must be 'http' or 'zmq'"):
        df.add_reward_service("http://localhost:1/score", protocol="grpc")
    with pytest.raises(CompileError, match="needs a reward"):  # the logic names a missing role
        df.define_training_step(["prompt"], ["loss"], SEED)
    df.add_reward_function("hybridflow.data.tasks:last_digit_reward")
    df.add_reference_model("tiny")
    grpo = SEED.replace(
        "ppo_loss(reward_score, kl_div)", "grpo_loss(reward_score, kl_div, kl_coef=0.1)"
    )
    df.define_training_step(["prompt"], ["loss"], grpo)
    ok = df.topology()
    assert ok.stages["engine"].roles["actor"].options["kl_loss_coef"] == 0.1
    # defaults without GPUs: actor, rollout and reference share a process; the reward
    # function gets its own
    assert {s: sorted(c.roles) for s, c in ok.stages.items()} == {
        "engine": ["actor", "reference", "rollout"],
        "reward": ["reward"],
    }
    clash = DataflowBuilder()
    clash.add_actor("tiny", kl_loss_coef=0.5)
    clash.add_reference_model("tiny")
    clash.add_reward_function("hybridflow.data.tasks:last_digit_reward")
    clash.define_training_step(["prompt"], ["loss"], grpo)
    with pytest.raises(
        ConfigError, match=r"actor.kl_loss_coef: 0.5 conflicts with the training step"
    ):
        clash.topology()
    with pytest.raises(ConfigError, match=r"device_mapping\.critic: no such role here"):
        df.build(device_mapping={"critic": "cpu"})  # no critic in this job
    bad_model = DataflowBuilder()
    bad_model.add_actor("./no/such/model")
    bad_model.add_reward_function("hybridflow.data.tasks:last_digit_reward")
    bad_model.define_training_step(
        ["prompt"],
        ["loss"],
        "response = actor.generate(prompt)\ns = reward.score(response)\nloss = grpo_loss(s)\nactor.update(loss)",
    )
    with pytest.raises(ConfigError, match=r"no model directory at '\./no/such/model'"):
        bad_model.build()


def test_reward_service_and_generate_options_reach_their_roles():
    df = DataflowBuilder()
    df.add_actor("tiny", device_mapping="cpu")
    df.add_reward_service(
        url="http://127.0.0.1:9/score", protocol="http", max_batch=8, timeout_s=2.0
    )
    df.define_training_step(
        ["prompt"],
        ["rewards"],
        "response = actor.generate(prompt, n=4, temperature=0.7, max_new_tokens=5)\n"
        "reward_score = reward.score(prompt, response)\n"
        "loss = grpo_loss(reward_score)\nactor.update(loss)",
    )
    topo = df.topology()
    reward = topo.stages["reward"].roles["reward"]
    assert reward.backend == "http"
    assert reward.options == {
        "url": "http://127.0.0.1:9/score",
        "max_batch": 8,
        "timeout_s": 2.0,
        "tokenizer": "builtin",
    }
    engine_roles = topo.stages["engine"].roles
    assert engine_roles["rollout"].options["temperature"] == 0.7
    assert engine_roles["rollout"].options["max_new_tokens"] == 5
    assert (
        engine_roles["actor"].options["temperature"] == 0.7
    )  # log-probs at the sampler's temperature
    assert topo.data.options["samples_per_prompt"] == 4
    assert "group_index" in topo.data.fields
    assert to_dict(topo)["dataflow"][0]["op"] == "generate"


class NodeLauncher:
    """A multi-host launcher stand-in (the seam: `assign_nodes` before each run)."""

    def __init__(self) -> None:
        self.nodes: dict[str, str] = {}

    def assign_nodes(self, nodes: dict[str, str]) -> None:
        self.nodes = nodes


def test_node_names_need_a_multi_host_launcher(tmp_path):
    def job(**actor_options):
        df = DataflowBuilder()
        df.add_actor(
            "tiny", device_mapping=[("node0", "cuda:0"), ("node1", "cuda:0")], **actor_options
        )
        df.add_reward_function("hybridflow.data.tasks:last_digit_reward", device_mapping="cpu")
        df.define_training_step(
            ["prompt"],
            ["loss"],
            "r = actor.generate(prompt, n=2)\ns = reward.score(r)\nloss = grpo_loss(s)\nactor.update(loss)",
        )
        return df

    with pytest.raises(
        ConfigError, match="node 'node0': placing roles on other hosts needs a multi-host launcher"
    ):
        job().build(log_dir=tmp_path)
    # With a launcher that places processes on hosts, the two actor replicas are the ranks
    # of one sharded model (FSDP), so planning accepts them...
    job().build(log_dir=tmp_path, launcher=NodeLauncher())
    # ...unless sharding is switched off: independent copies would train apart.
    with pytest.raises(ConfigError, match=r"roles\.actor\.options\.fsdp: role 'actor' trains"):
        job(fsdp=False).build(log_dir=tmp_path, launcher=NodeLauncher())


def test_a_rollout_mapped_apart_gets_its_own_process_and_a_weight_sync():
    df = DataflowBuilder()
    df.add_actor("tiny", device_mapping={"actor": "cpu", "rollout": "cpu:1"})
    df.add_reward_function("hybridflow.data.tasks:last_digit_reward", device_mapping="cpu")
    df.define_training_step(
        ["prompt"],
        ["loss"],
        "r = actor.generate(prompt, n=2)\ns = reward.score(r)\nloss = grpo_loss(s)\nactor.update(loss)",
    )
    topo = df.topology()
    assert {s: sorted(c.roles) for s, c in topo.stages.items()} == {
        "actor": ["actor", "reward"],
        "rollout": ["rollout"],
    }
    assert [op.label for op in topo.dataflow][-2:] == ["actor.reshard", "rollout.load_weights"]
    from hybridflow.pipeline.plan.weight_links import links

    assert len(links(topo)) == 1  # the disaggregated reshard is wired from the topology
    with pytest.raises(ConfigError, match="share cuda:0 without being identical"):
        df.topology(
            device_mapping={"actor": ["cuda:0", "cuda:1"], "rollout": "cuda:0"}, cuda_count=2
        )


def test_the_step_is_compiled_once_per_logic_and_roles(monkeypatch):
    """define_training_step, topology() and every Engine call share one compile; a change
    of the logic or of the declared roles compiles again."""
    from hybridflow.pipeline.api import builder as builder_module

    calls = []
    real = builder_module.compile_step

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(builder_module, "compile_step", counting)
    df = DataflowBuilder()
    df.add_actor("tiny")
    df.add_reward_function("hybridflow.data.tasks:last_digit_reward", device_mapping="cpu")
    logic = "r = actor.generate(prompt, n=2)\ns = reward.score(r)\nloss = grpo_loss(s)\nactor.update(loss)"
    df.define_training_step(["prompt"], ["loss"], logic)
    first = df.compile()
    df.topology()
    assert df.compile() is first and len(calls) == 1
    df.add_reference_model("tiny")
    assert df.compile() is not first and len(calls) == 2
    df.define_training_step(["prompt"], ["loss"], logic.replace("n=2", "n=4"))
    assert len(calls) == 3

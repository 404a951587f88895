"""Topology schema: a table of bad configs -> the exact ConfigError text, plus presets,
overrides and hashing. Registry checks (backends, data source, driver ops, sinks) run
through `build_plan`, as `hybridflow validate` does."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hybridflow.config.loader import config_hash, from_dict, to_dict
from hybridflow.config.schema import RoleConfig, Topology, load_topology, preset_names
from hybridflow.errors import ConfigError
from hybridflow.pipeline.plan.planner import build_plan


def base() -> dict[str, Any]:
    return {
        "name": "t",
        "run": {"steps": 2, "step_batch": 8, "micro_batch": 2},
        "stages": {
            "rollout": {"roles": {"rollout": {"backend": "synthetic"}}},
            "reward": {"roles": {"reward": {"backend": "synthetic"}}},
            "actor": {"roles": {"actor": {"backend": "synthetic"}}},
        },
        "dataflow": [
            {
                "role": "rollout",
                "op": "generate",
                "inputs": ["prompt_ids"],
                "outputs": ["response_ids"],
            },
            {"role": "reward", "op": "score", "inputs": ["response_ids"], "outputs": ["rewards"]},
            {"role": "actor", "op": "update", "inputs": ["response_ids", "rewards"]},
            {"role": "actor", "op": "optimizer_step", "scope": "step"},
        ],
    }


def edit(path: str, value: Any) -> dict[str, Any]:
    """base() with `value` set at dotted `path` (list indices as numbers); DELETE removes."""
    data = base()
    node: Any = data
    keys = [int(k) if k.isdigit() else k for k in path.split(".")]
    for k in keys[:-1]:
        node = node.setdefault(k, {}) if isinstance(node, dict) else node[k]
    if value is DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return data


DELETE = object()

BAD = [
    ("stages.reward.replicas", 0, "stages.reward.replicas: must be >= 1, got 0"),
    ("run.steps", 0, "run.steps: must be >= 1, got 0"),
    ("run.max_inflight", 0, "run.max_inflight: must be >= 1, got 0"),
    ("run.max_offpolicy_steps", -1, "run.max_offpolicy_steps: must be >= 0, got -1"),
    (
        "run.micro_batch",
        3,
        "run.micro_batch: 3 does not divide run.step_batch 8; use one of 1, 2, 4, 8",
    ),
    ("run.mode", "async", "run.mode: must be one of 'streamed', 'sequential'; got 'async'"),
    ("run.stpes", 3, "run.stpes: unknown key; did you mean 'steps'?"),
    ("run.steps", "three", "run.steps: expected int, got str 'three'"),
    ("stages.reward.replcas", 2, "stages.reward.replcas: unknown key; did you mean 'replicas'?"),
    (
        "stages.reward.devices",
        "gpu0",
        "stages.reward.devices: 'gpu0' is not a device; use 'cpu' or 'cuda:N'",
    ),
    (
        "stages.reward.devices",
        ["cpu", "cpu"],
        "stages.reward.devices: lists 2 device(s) for 1 replica(s); give one device per "
        "replica or a single device string",
    ),
    ("stages.reward.roles", {}, "stages.reward.roles: must host at least one role"),
    ("stages", {}, "stages: must define at least one stage"),
    ("dataflow", [], "dataflow: must list at least one op"),
    (
        "stages.actor.roles",
        {"reward": {"backend": "synthetic"}},
        "stages.actor.roles.reward: role 'reward' is already hosted by stage 'reward'; "
        "a role lives in exactly one stage (use replicas to scale it)",
    ),
    (
        "dataflow.1.role",
        "critic",
        "dataflow[1].role: role 'critic' is hosted by no stage; add it under "
        "stages.<name>.roles or use one of: actor, reward, rollout, driver",
    ),
    (
        "dataflow.1.inputs",
        ["values"],
        "dataflow[1].inputs: value 'values' is consumed by reward.score before any op "
        "produces it; available here: prompt_ids, response_ids",
    ),
    (
        "dataflow.1.outputs",
        ["response_ids"],
        "dataflow[1].outputs: value 'response_ids' is already produced by dataflow[0] "
        "(rollout.generate); every value has exactly one producer",
    ),
    (
        "dataflow.1.scope",
        "epoch",
        "dataflow[1].scope: must be one of 'micro_batch', 'step'; got 'epoch'",
    ),
    ("dataflow.1.params", {"step": 3}, "dataflow[1].params.step: is set by the runtime; rename it"),
    (
        "dataflow.1.params",
        {"temps": [1, 2]},
        "dataflow[1].params.temps: must be a scalar (number, string, bool, null), got list",
    ),
    ("dataflow.0.role", DELETE, "dataflow[0].role: is required"),
    (
        "liveness",
        {"heartbeat_interval_s": 2.0, "heartbeat_timeout_s": 1.0},
        "liveness.heartbeat_timeout_s: must be greater than liveness.heartbeat_interval_s "
        "(2.0), got 1.0",
    ),
    ("liveness", {"startup_timeout_s": 0}, "liveness.startup_timeout_s: must be > 0, got 0.0"),
    ("log_level", "LOUD", "log_level: must be one of DEBUG, INFO, WARNING, ERROR; got 'LOUD'"),
    (
        "name",
        "my run",
        "name: 'my run' is not a valid name (letters, digits, _ and -; starts with a letter)",
    ),
    (
        "stages.rollout.roles",
        {"driver": {"backend": "synthetic"}},
        "stages.rollout.roles.driver: 'driver' is not a valid role name ('driver' is reserved "
        "for coordinator ops)",
    ),
    ("transport.protocol", "udp", "transport.protocol: must be one of 'ipc', 'tcp'; got 'udp'"),
    # sizes that would exhaust memory are bounded, each with its key (issue 12)
    (
        "run.step_batch",
        10**12,
        "run.step_batch: must be <= 1048576, got 1000000000000 (samples held per step)",
    ),
    (
        "run",
        {"step_batch": 524288, "micro_batch": 1},
        "run.micro_batch: must be <= 65536, got 524288 (micro-batches per step = "
        "run.step_batch / run.micro_batch; raise micro_batch)",
    ),
    (
        "run.max_inflight",
        10**9,
        "run.max_inflight: must be <= 1024, got 1000000000 (tasks per replica)",
    ),
    (
        "run.max_offpolicy_steps",
        10**6,
        "run.max_offpolicy_steps: must be <= 1024, got 1000000 (steps in flight at once, "
        "each holding its samples)",
    ),
    (
        "transport.hwm",
        10**9,
        "transport.hwm: must be <= 65536, got 1000000000 (messages queued per socket)",
    ),
    (
        "liveness",
        {"task_timeout_s": -1},
        "liveness.task_timeout_s: must be a finite number of seconds > 0, got -1.0",
    ),
    (
        "dataflow.1.timeout_s",
        0,
        "dataflow[1].timeout_s: must be a finite number of seconds > 0, got 0.0",
    ),
]


@pytest.mark.parametrize(("path", "value", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_config_names_the_key_and_the_fix(path, value, message):
    with pytest.raises(ConfigError) as info:
        load_topology(edit(path, value))
    assert str(info.value) == message


def test_sequential_mode_forbids_offpolicy():
    data = base()
    data["run"].update(mode="sequential", max_offpolicy_steps=1)
    with pytest.raises(
        ConfigError, match=r"^run.max_offpolicy_steps: must be 0 when run.mode is 'sequential'"
    ):
        load_topology(data)


REGISTRY_BAD = [
    (
        "stages.reward.roles.reward.backend",
        "nope",
        "stages.reward.roles.reward.backend: unknown backend 'nope' for role kind 'reward'; "
        "known: function, http, model, synthetic, zmq",
    ),
    ("data.source", "s3", "data.source: unknown data source 's3'; known: synthetic"),
    (
        "data.fields",
        ["prompt_ids", "answers"],
        "data.fields[1]: the synthetic source cannot provide 'answers'; it provides "
        "prompt_ids, prompt_mask, sample_idx",
    ),
    (
        "data.options",
        {"prompt_length": 0},
        "data.options.prompt_length: must be an int >= 1, got 0",
    ),
    (
        "metrics.backends",
        ["jsonl", "carrier_pigeon"],
        "metrics.backends[1]: unknown metrics backend 'carrier_pigeon'; known: jsonl, memory",
    ),
    (
        "dataflow.3",
        {"role": "driver", "op": "no_such_op", "scope": "step"},
        "dataflow[3].op: unknown driver op 'no_such_op'; registered: identity, or give "
        "'package.module:function'",
    ),
    (
        "stages.reward.devices",
        "cuda:7",
        "stages.reward.devices: cuda:7 is not available: this machine has 0 CUDA device(s)",
    ),
]


@pytest.mark.parametrize(
    ("path", "value", "message"), REGISTRY_BAD, ids=[b[0] for b in REGISTRY_BAD]
)
def test_registry_checks_name_the_key(path, value, message):
    import torch

    if path == "stages.reward.devices" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8+ GPUs")
    topo = load_topology(edit(path, value))
    with pytest.raises(ConfigError) as info:
        build_plan(topo, check_devices=True)
    # registries grow as backends/sinks are added: compare up to the "known:" list's start
    got, want = str(info.value), message
    if "unknown backend" in want or "metrics backend" in want or "data source" in want:
        assert got.split("known: ")[0] == want.split("known: ")[0]
        assert set(want.split("known: ")[1].split(", ")) <= set(got.split("known: ")[1].split(", "))
    elif "registered: " in want:  # the driver-op registry grows too
        assert got.split("registered: ")[0] == want.split("registered: ")[0]
    else:
        assert got == want


def test_presets_load_and_plan():
    assert "overlap" in preset_names()
    topo = load_topology("overlap")
    plan = build_plan(topo)
    assert topo.run.micro_batches >= 8
    assert [p.name for p in plan.processes] == ["rollout/0", "reward/0", "actor/0"]
    assert [op.head for op in plan.ops] == [True, False, False, False, False, False]
    assert plan.ops[3].deps == (0, 1, 2)  # a step op waits for everything before it


def test_unknown_config_names_presets():
    with pytest.raises(
        ConfigError, match=r"neither a file nor a bundled preset; presets: .*overlap"
    ):
        load_topology("no-such-thing")


def test_overrides_and_file(tmp_path):
    import yaml

    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump(base()))
    topo = load_topology(str(f), ["run.steps=5", "stages.reward.replicas=2"])
    assert topo.run.steps == 5 and topo.stages["reward"].replicas == 2
    with pytest.raises(ConfigError, match=r"^stages.reward.replicas: must be >= 1, got 0$"):
        load_topology(str(f), ["stages.reward.replicas=0"])
    # list items: `dataflow.1.phase` and the form errors print, `dataflow[1].phase`
    for key in ("dataflow.1.phase", "dataflow[1].phase"):
        assert load_topology(str(f), [f"{key}=scoring"]).dataflow[1].phase == "scoring"
    with pytest.raises(ConfigError, match=r"^dataflow.9: '9' is not an index of this list"):
        load_topology(str(f), ["dataflow[9].phase=x"])


def test_round_trip_and_hash_are_stable():
    topo = load_topology(base())
    again = from_dict(Topology, copy.deepcopy(to_dict(topo)))
    assert again == topo and config_hash(again) == config_hash(topo)
    other = load_topology(edit("run.steps", 3))
    assert config_hash(other) != config_hash(topo)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"model": "tiny", "lrr": 1.0},
            "stages.engine.roles.actor.options.lrr: unknown key; did you mean 'lr'?",
        ),
        (
            {"model": "tiny", "lr": "fast"},
            "stages.engine.roles.actor.options.lr: expected a number",
        ),
        ({}, "stages.engine.roles.actor.options.model: is required"),
    ],
)
def test_role_options_are_checked_before_any_process_starts(options, message):
    topo = load_topology("grpo", [f"stages.engine.roles.actor.options={options!r}"])
    with pytest.raises(ConfigError) as info:
        build_plan(topo)
    assert str(info.value).startswith(message)


def test_stage_hosts_are_checked_and_say_where_each_replica_runs():
    """`stages.<s>.hosts`: one host for every replica or one per replica; names of this
    machine mean here; another name is a node, whose GPUs this machine does not count."""
    import socket

    from hybridflow.pipeline.plan.planner import build_plan

    data = edit("stages.reward.hosts", ["node1", "node2"])
    with pytest.raises(ConfigError, match=r"^stages.reward.hosts: lists 2 host\(s\) for 1"):
        load_topology(data)
    with pytest.raises(ConfigError, match=r"^stages.reward.hosts: 'node 1' is not a host name"):
        load_topology(edit("stages.reward.hosts", "node 1"))
    data = edit("stages.reward.replicas", 2)
    data["stages"]["reward"] |= {"hosts": ["localhost", "node1"], "devices": ["cpu", "cuda:7"]}
    data["stages"]["actor"]["hosts"] = socket.gethostname()
    plan = build_plan(load_topology(data), check_devices=True)  # cuda:7 is node1's
    assert plan.nodes() == {"reward/1": "node1"}
    assert [p.host for p in plan.processes] == ["", "", "node1", ""]
    data["stages"]["reward"]["hosts"] = ["node1", "localhost"]  # cuda:7 here: refused
    with pytest.raises(ConfigError, match=r"^stages.reward.devices\[1\]: cuda:7 is not avail"):
        build_plan(load_topology(data), check_devices=True)


def test_a_roles_kind_is_its_own_else_the_name_it_is_hosted_under():
    assert RoleConfig("hf").kind_of("critic") == "critic"
    assert RoleConfig("function", kind="reward").kind_of("judge") == "reward"

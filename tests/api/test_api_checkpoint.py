"""Checkpoint building blocks without processes: the state codec (safetensors + JSON, no
pickle), the schedule, atomic commit / prune / `latest`, RNG and driver-op state."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from hybridflow.config.schema import CheckpointConfig
from hybridflow.errors import ConfigError, PipelineError
from hybridflow.pipeline.checkpoint.checkpointer import Checkpointer, load_drivers, save_drivers
from hybridflow.pipeline.checkpoint.layout import FORMAT
from hybridflow.pipeline.checkpoint.resume import read_meta, resolve
from hybridflow.pipeline.checkpoint.stage import derive_seed, rng_state, seed_process, set_rng_state
from hybridflow.pipeline.checkpoint.tree import read_state, write_state


def test_state_trees_round_trip_through_safetensors_and_json(tmp_path):
    state = {
        "model": {"w": torch.randn(3, 2), "b": torch.zeros(2, dtype=torch.bfloat16)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},  # int keys
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],  # a tuple
        },
        "generator": torch.Generator().manual_seed(1).get_state(),
        "version": 7,
        "best": math.inf,
        "none": None,
        "__weird": "dunder keys are tagged, not taken for tags",
    }
    write_state(state, tmp_path, "actor")
    back = read_state(tmp_path, "actor")
    assert back.keys() == state.keys()
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert back["model"]["b"].dtype == torch.bfloat16
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], torch.ones(2))
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["version"] == 7 and back["best"] == math.inf and back["none"] is None
    assert back["__weird"] == state["__weird"]
    assert torch.equal(back["generator"], state["generator"])
    text = (tmp_path / "actor.json").read_text()
    json.loads(text)  # strict JSON (no NaN/Infinity literals)
    assert "Infinity" not in text


def test_unknown_json_tags_and_objects_are_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"a": {"__pickle__": "..."}}))
    with pytest.raises(PipelineError, match="unknown tag '__pickle__'"):
        read_state(tmp_path, "x")
    with pytest.raises(TypeError, match="cannot checkpoint a object at a"):
        write_state({"a": object()}, tmp_path, "y")


def test_rng_states_restore_every_generator():
    seed_process(123)
    state = rng_state()
    a = (torch.rand(3), random.random())
    set_rng_state(state)
    b = (torch.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    assert derive_seed(0, "engine", 0) != derive_seed(0, "engine", 1)
    assert derive_seed(0, "engine", 0) == derive_seed(0, "engine", 0)


def test_schedule_commit_prune_latest(tmp_path):
    cfg = CheckpointConfig(str(tmp_path), save_interval=2, keep_last=2)
    c = Checkpointer(cfg, last_step=6)
    assert [s for s in range(7) if c.due(s)] == [1, 3, 5, 6]  # every 2 steps and the end
    assert c.next_due(2) == 3 and c.next_due(6) == 6
    for step in (1, 3, 5):
        tmp = c.begin(step)
        (tmp / "part").write_text("x")
        c.commit(tmp, {"format": FORMAT, "step": step + 1})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step-00000004", "step-00000006"]
    assert resolve("latest", tmp_path).name == "step-00000006"
    assert resolve(tmp_path).name == "step-00000006"  # a save dir means its latest
    stale = c.begin(6)  # a crash mid-save leaves a .tmp- dir: never resumed from...
    assert resolve("latest", tmp_path).name == "step-00000006"
    c.begin(6)  # ...and swept by the next save
    assert not stale.exists()
    with pytest.raises(ConfigError, match="save_interval"):
        CheckpointConfig(str(tmp_path), save_interval=-1).validate()
    with pytest.raises(ConfigError, match="not a hybridflow checkpoint"):
        (tmp_path / "bogus").mkdir()
        (tmp_path / "bogus" / "meta.json").write_text('{"format": 99}')
        read_meta(tmp_path / "bogus")


class CountingDriver:
    """A driver op with state (like an adaptive KL coefficient)."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def __call__(self, batch, params):  # pragma: no cover - not run here
        return {}, {}

    def state_dict(self):
        return {"seen": list(self.seen)}

    def load_state_dict(self, state):
        self.seen = list(state["seen"])


def test_driver_op_state_is_saved_and_restored(tmp_path):
    a = CountingDriver()
    a.seen = [0.5, 0.25]
    save_drivers({3: a, 4: lambda b, p: ({}, {})}, tmp_path)  # stateless ops: nothing
    assert sorted(p.name for p in (tmp_path / "coordinator").iterdir()) == ["driver-3.json"]
    b = CountingDriver()
    load_drivers({3: b}, tmp_path)
    assert b.seen == [0.5, 0.25]
    with pytest.raises(PipelineError, match="cannot load it"):
        load_drivers({3: lambda b, p: ({}, {})}, tmp_path)

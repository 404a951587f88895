"""Experiment trackers as sinks (issue 13 item 3): a real run over stage processes logs to
jsonl, wandb (offline), mlflow (local SQLite store) and TensorBoard at once; each
tracker's own files are read back with the tracker's own reader and equal the jsonl
rows; a resumed run continues the same wandb run, mlflow run and TensorBoard directory.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_helpers import small_topology

from hybridflow.config.schema import load_topology
from hybridflow.errors import ConfigError
from hybridflow.pipeline.api.builder import _metrics_section
from hybridflow.pipeline.observe import trackers
from hybridflow.pipeline.observe.metrics import TensorBoardSink
from hybridflow.pipeline.plan.planner import build_plan
from hybridflow.pipeline.runtime.runner import run_topology

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

ALL = ["jsonl", "wandb", "mlflow", "tensorboard"]


@pytest.fixture(autouse=True)
def offline_trackers(monkeypatch, tmp_path):
    """wandb offline with its config/cache under tmp_path; mlflow on its local default."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    for var in ("WANDB_PROJECT", "WANDB_NAME", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)


# -- readers: each tracker's files through its own format -------------------------------


def jsonl_rows(run_dir: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r.pop("step"): {k: v for k, v in r.items() if v is not None} for r in rows}


def wandb_records(path: Path):
    """The records of a `run-<id>.wandb` file: wandb's LevelDB-style log (a 7-byte
    header, 32 KiB blocks of [crc32 u32, length u16, type u8] + data chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL/FIRST start, MIDDLE/LAST add
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def wandb_history(path: Path) -> tuple[str, dict[int, dict[str, float]]]:
    """(run id, step -> metrics) of one offline run file."""
    run_id, steps = "", {}
    for rec in wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = rec.run.run_id
        elif kind == "history":
            row = {
                (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                for i in rec.history.item
            }
            steps[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
    return run_id, steps


def mlflow_history(run_dir: Path, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlflow' / 'mlflow.db').resolve()}")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    steps: dict[int, dict[str, float]] = {}  # of the last run found
    for key in runs[-1].data.metrics:
        for m in client.get_metric_history(runs[-1].info.run_id, key):
            assert key not in steps.setdefault(m.step, {}), f"{key} twice at step {m.step}"
            steps[m.step][key] = m.value
    return runs, steps


def tensorboard_history(run_dir: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    steps: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            assert tag not in steps.setdefault(ev.step, {}), f"{tag} twice at step {ev.step}"
            steps[ev.step][tag] = ev.value
    return steps


def same(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]], rel=0.0):
    assert sorted(got) == sorted(want)
    for step, row in want.items():
        assert got[step] == pytest.approx(row, rel=rel, abs=0.0), f"step {step}"


# -- the run -------------------------------------------------------------------------------


def test_run_logs_to_every_tracker_and_a_resume_continues_them(tmp_path):
    data = small_topology(tmp_path, steps=2)
    data["metrics"] = {"backends": ALL, "options": {"tags": ["smoke"]}}
    run_dir = tmp_path / "run"
    run_topology(load_topology(data))  # steps 0, 1
    data["run"]["steps"] = 4
    run_topology(load_topology(data), start_step=2)  # resumed: steps 2, 3

    rows = jsonl_rows(run_dir)
    assert sorted(rows) == [0, 1, 2, 3] and "timing/step" in rows[3]

    # wandb: two offline files (one per job) of ONE run id, steps 0..1 then 2..3
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    (id0, first), (id1, second) = wandb_history(files[0]), wandb_history(files[1])
    stored = json.loads((run_dir / "wandb" / trackers.BOOK_FILE).read_text())
    assert id0 == id1 == stored["run_id"] and stored["last_step"] == 3
    assert sorted(first) == [0, 1] and sorted(second) == [2, 3]
    same(first | second, rows)

    # mlflow: one run in the experiment named after the topology, each step once
    runs, history = mlflow_history(run_dir, "rt")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["smoke"] == "" and runs[0].info.run_name == "rt"
    same(history, rows)

    # TensorBoard: one directory, two event files, each step once (float32 values)
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2
    assert not [p for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("events")]
    same(tensorboard_history(run_dir), rows, rel=1e-6)


# -- sink level: overlap after a crash, errors, laziness -----------------------------------


def test_a_resume_over_already_logged_steps_logs_each_step_once(tmp_path):
    """A crash after step 3 with a checkpoint at step 1: the resumed run (start 2) logs
    steps 2, 3 again. TensorBoard keeps the new values (purge_step), the trackers the
    ones they already have (a resumed run recomputes the same values)."""
    run_dir = tmp_path / "run"
    tb, ml = TensorBoardSink(run_dir), trackers.MlflowSink(run_dir)
    for s in range(4):
        tb.write(s, {"x": float(s)})
        ml.write(s, {"x": float(s)})
    tb.close()
    ml.close()  # (the "crash")
    tb, ml = TensorBoardSink(run_dir, start_step=2), trackers.MlflowSink(run_dir, start_step=2)
    for s in range(2, 5):
        tb.write(s, {"x": 10.0 * s})
        ml.write(s, {"x": 10.0 * s})
    tb.close()
    ml.close()
    assert tensorboard_history(run_dir) == {
        0: {"x": 0},
        1: {"x": 1},
        2: {"x": 20},
        3: {"x": 30},
        4: {"x": 40},
    }
    runs, history = mlflow_history(run_dir, "run")
    assert len(runs) == 1
    assert history == {0: {"x": 0}, 1: {"x": 1}, 2: {"x": 2}, 3: {"x": 3}, 4: {"x": 40}}


def test_a_fresh_run_starts_new_tracker_runs(tmp_path):
    run_dir = tmp_path / "run"
    for _ in range(2):
        tb, ml = TensorBoardSink(run_dir), trackers.MlflowSink(run_dir)
        tb.write(0, {"x": 1.0})
        ml.write(0, {"x": 1.0})
        tb.close()
        ml.close()
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1  # the old one removed
    runs, _ = mlflow_history(run_dir, "run")
    assert len(runs) == 2


def test_a_tracker_that_is_not_installed_fails_at_validate(tmp_path, monkeypatch):
    missing = trackers.Requirement(("hybridflow_no_such_tracker",), "pip install wandb")
    monkeypatch.setitem(trackers.REQUIREMENTS, "wandb", missing)
    data = small_topology(tmp_path)
    data["metrics"] = {"backends": ["jsonl", "wandb"]}
    with pytest.raises(ConfigError) as info:
        build_plan(load_topology(data))
    assert info.value.path == "metrics.backends[1]"
    assert "pip install wandb" in str(info.value) and "hybridflow[trackers]" in str(info.value)


def test_trackers_are_imported_only_when_configured(tmp_path):
    """Checking a topology imports no tracker, configured or not; running one without
    trackers never does."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from pipeline_helpers import small_topology;"
        "from pathlib import Path;"
        "from hybridflow.config.schema import load_topology;"
        "from hybridflow.pipeline.plan.planner import build_plan;"
        "d = small_topology(Path(sys.argv[2]));"
        "d['metrics'] = {'backends': ['jsonl', 'wandb', 'mlflow']};"
        "build_plan(load_topology(d));"
        "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))"
    )
    here = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", code, here, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONWARNINGS": "error"},
        check=True,
    )
    assert out.stdout.strip() == "[]"


def test_metrics_options_are_checked_with_their_path(tmp_path):
    data = small_topology(tmp_path)
    data["metrics"] = {"backends": ["jsonl"], "options": {"projekt": "x"}}
    with pytest.raises(ConfigError) as info:
        load_topology(data)
    assert info.value.path == "metrics.options.projekt" and "project" in str(info.value)


def test_python_api_metrics_backend_takes_a_list_or_the_section(tmp_path):
    assert _metrics_section(["jsonl", "wandb", "mlflow"]) == {
        "backends": ["jsonl", "wandb", "mlflow"]
    }
    assert _metrics_section("tensorboard") == {"backends": ["tensorboard"]}
    assert _metrics_section(None) == {"backends": ["null"]}
    section = {"backends": ["mlflow"], "options": {"project": "p", "tags": ["a"]}}
    data = small_topology(tmp_path)
    data["metrics"] = _metrics_section(section)
    topo = load_topology(data)
    assert topo.metrics.backends == ("mlflow",) and topo.metrics.options.tags == ("a",)

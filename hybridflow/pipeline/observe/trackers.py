"""Experiment trackers as metrics sinks: `wandb` and `mlflow` in `metrics.backends`.

Each is a MetricsSink (metrics.py): built once per job with the run directory, the
topology and `start_step`, `write(step, metrics)` per step from the io thread, `close()`
once. They log the same finite values the jsonl sink writes (non-finite ones, null in
jsonl, are left out), each metric under its own key, at `step`.

    wandb   wandb.init(dir=<run_dir>) -> <run_dir>/wandb/ (an offline run, under
            WANDB_MODE=offline, is a `run-<id>.wandb` file there for `wandb sync`)
    mlflow  an MlflowClient on $MLFLOW_TRACKING_URI, else on the SQLite file
            <run_dir>/mlflow/mlflow.db with artifacts in <run_dir>/mlflow/artifacts.
            (MLflow 3 keeps the `./mlruns` file store in maintenance mode and refuses it
            unless MLFLOW_ALLOW_FILE_STORE is set, so the local default is SQLite.)

Names (`metrics.options`, config/runtime.py TrackerOptions; the environment when unset):
    wandb project   options.project, $WANDB_PROJECT, the topology's name
    mlflow experiment options.project, $MLFLOW_EXPERIMENT_NAME, the topology's name
    run name        options.run_name, $WANDB_NAME (wandb), the topology's name
    tags            options.tags (wandb tags; mlflow tags with an empty value)
Anything else is the tracker's own environment (WANDB_MODE, WANDB_ENTITY, WANDB_API_KEY,
MLFLOW_TRACKING_TOKEN, ...). wandb gets the topology as its run config; mlflow as the
artifact `topology.json`.

Resume: `<run_dir>/<tracker>/hybridflow-run.json` (`RunBook`) holds the tracker's run
id and the last step it logged. A job that starts at step 0 opens a new tracker run; one
that starts at step r > 0 (a resumed run, or the Python API's next `train` call)
continues the stored run id, so a resumed run is one run in the tracker. Steps up to the
stored last step are not logged again: after a crash between a checkpoint and the
crash, those steps are already in the tracker run, and the resumed run recomputes the
same values (resume is bit-exact; only timings differ), which wandb would refuse anyway
(its steps only go up).

Invariants: wandb and mlflow are imported only in these constructors (a topology without
them never imports them); `check_requirements` reports a tracker that is not installed
when the topology is checked, as a ConfigError naming `metrics.backends[i]` and the pip
command, never at the first step.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.errors import ConfigError

if TYPE_CHECKING:
    from hybridflow.config.schema import Topology, TrackerOptions

log = logging.getLogger("hybridflow.observe.trackers")

BOOK_FILE = "hybridflow-run.json"


@dataclass(frozen=True)
class Requirement:
    modules: tuple[str, ...]  # importable module names the sink needs
    pip: str  # how to install them


# What each tracker needs installed (`pip install 'hybridflow[trackers]'` brings both).
# mlflow-skinny is enough (the full `mlflow` works too); SQLAlchemy and alembic back the
# SQLite store that is the local default.
REQUIREMENTS: dict[str, Requirement] = {
    "wandb": Requirement(("wandb",), "pip install wandb"),
    "mlflow": Requirement(
        ("mlflow", "sqlalchemy", "alembic"), "pip install mlflow-skinny sqlalchemy alembic"
    ),
}


def check_requirements(names: tuple[str, ...] | list[str]) -> None:
    """A configured tracker whose package is missing -> ConfigError (nothing imported)."""
    for i, name in enumerate(names):
        req = REQUIREMENTS.get(name)
        if req is None:
            continue
        modules = req.modules
        if name == "mlflow" and not _mlflow_uri_is_local():
            modules = ("mlflow",)  # a tracking server: no local SQL store
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(
                f"metrics.backends[{i}]",
                f"metrics backend {name!r} needs {', '.join(missing)}, which is not "
                f"installed; run `{req.pip}` (or `pip install 'hybridflow[trackers]'`)",
            )


def _mlflow_uri_is_local() -> bool:
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    return not uri or uri.startswith("sqlite:")


# ---------------------------------------------------------------------------------------


@dataclass
class RunBook:
    """Which tracker run a run directory logs to, and the last step logged there."""

    path: Path
    run_id: str = ""
    last_step: int = -1

    @classmethod
    def open(cls, home: Path, start_step: int) -> RunBook:
        """The stored book when resuming (start_step > 0), else a fresh one."""
        home.mkdir(parents=True, exist_ok=True)
        path = home / BOOK_FILE
        if start_step > 0 and path.is_file():
            try:
                data = json.loads(path.read_text())
                return cls(path, str(data["run_id"]), int(data["last_step"]))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("%s is unreadable (%s); starting a new tracker run", path, exc)
        elif start_step > 0:
            log.warning("%s does not exist; the resumed run starts a new tracker run", path)
        return cls(path)

    def logged(self, step: int) -> bool:
        return step <= self.last_step

    def save(self, run_id: str | None = None, step: int | None = None) -> None:
        if run_id is not None:
            self.run_id = run_id
        if step is not None:
            self.last_step = step
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"run_id": self.run_id, "last_step": self.last_step}))
        tmp.replace(self.path)  # atomic: a crash leaves the old book or the new one


def _options(topology: Topology | None) -> TrackerOptions:
    from hybridflow.config.schema import TrackerOptions

    return topology.metrics.options if topology is not None else TrackerOptions()


def _config(topology: Topology | None) -> dict[str, Any]:
    """The topology as plain JSON data (anything exotic in `options` as its repr)."""
    if topology is None:
        return {}
    from hybridflow.config.loader import to_dict

    return json.loads(json.dumps(to_dict(topology), default=repr))


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    return {
        k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)
    }


# ---------------------------------------------------------------------------------------


class WandbSink:
    """Weights & Biases: one wandb run per hybridflow run, resumed by its stored id."""

    def __init__(self, run_dir: Path, topology: Topology | None = None, start_step: int = 0):
        import wandb

        opts = _options(topology)
        name = topology.name if topology is not None else run_dir.name
        run_dir.mkdir(parents=True, exist_ok=True)
        self.book = RunBook.open(run_dir / "wandb", start_step)
        run_id = self.book.run_id or uuid.uuid4().hex[:12]  # [a-z0-9], as wandb's own ids
        self.run = wandb.init(
            dir=str(run_dir),
            id=run_id,
            resume="allow",  # the stored id continues; a new one is created
            project=opts.project or os.environ.get("WANDB_PROJECT") or name,
            name=opts.run_name or os.environ.get("WANDB_NAME") or name,
            tags=list(opts.tags) or None,
            config=_config(topology),
            # No stdout capture (the console sink owns the terminal), no banner.
            settings=wandb.Settings(console="off", silent=True),
        )
        self.book.save(run_id=run_id)
        self.path = Path(self.run.dir).parent  # <run_dir>/wandb/<offline-|>run-<ts>-<id>
        log.info("wandb run %s (%s) in %s", run_id, self.run.project, self.path)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.book.logged(step):
            return
        self.run.log(_finite(metrics), step=step)
        self.book.save(step=step)

    def close(self) -> None:
        self.run.finish()


# MLflow metric names: alphanumerics, _ - . / : and space; anything else becomes "_".
_MLFLOW_BAD = re.compile(r"[^\w\-./: ]")
_MLFLOW_BATCH = 1000  # metrics per log_batch call (the tracking API's limit)


class MlflowSink:
    """MLflow: one mlflow run per hybridflow run, resumed by its stored id."""

    def __init__(self, run_dir: Path, topology: Topology | None = None, start_step: int = 0):
        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        opts = _options(topology)
        name = topology.name if topology is not None else run_dir.name
        home = (run_dir / "mlflow").resolve()
        self.book = RunBook.open(home, start_step)
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home / 'mlflow.db'}"
        # The SQLite store logs its schema migrations at INFO on first use: not news.
        for noisy in ("mlflow.store.db.utils", "alembic.runtime.migration"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        self.client = MlflowClient(tracking_uri=self.uri)
        self._metric = Metric
        run_id = self.book.run_id
        if run_id:
            try:
                self.client.update_run(run_id, status="RUNNING")
            except MlflowException as exc:
                log.warning("mlflow run %s not found (%s); starting a new one", run_id, exc)
                run_id = ""
        if not run_id:
            experiment = opts.project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or name
            found = self.client.get_experiment_by_name(experiment)
            if found is not None:
                exp_id = found.experiment_id
            else:
                local = self.uri.startswith("sqlite:") and "MLFLOW_TRACKING_URI" not in os.environ
                where = (home / "artifacts").as_uri() if local else None
                exp_id = self.client.create_experiment(experiment, artifact_location=where)
            run = self.client.create_run(
                exp_id, run_name=opts.run_name or name, tags={t: "" for t in opts.tags}
            )
            run_id = run.info.run_id
            if topology is not None:
                self.client.log_dict(run_id, _config(topology), "topology.json")
        self.run_id = run_id
        self.book.save(run_id=run_id)
        log.info("mlflow run %s at %s", run_id, self.uri)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.book.logged(step):
            return
        ms = int(time.time() * 1000)
        rows = [
            self._metric(_MLFLOW_BAD.sub("_", k), v, ms, step) for k, v in _finite(metrics).items()
        ]
        for i in range(0, len(rows), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=rows[i : i + _MLFLOW_BATCH])
        self.book.save(step=step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")

"""The pipeline runtime: stage processes, coordinator, step barriers, topology from config.

    config (Topology) --build_plan--> Plan --run_topology--> LocalLauncher (one process
    per stage replica) + Coordinator (asyncio: Scheduler rules, liveness, metrics sinks)

Public entry points (imported lazily: `python -m hybridflow.pipeline.runtime.launcher`, which every
stage process runs, must not import the whole runtime first):
  run_topology, RunResult                        runtime/runner.py, runtime/coordinator/
  build_plan, Plan                               plan/planner.py
  Launcher, LocalLauncher, ProcessSpec           runtime/launcher.py
  register_source, register_driver_op, register_sink   sources/, driver/, observe/ registries
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "run_topology": "hybridflow.pipeline.runtime.runner",
    "RunResult": "hybridflow.pipeline.runtime.coordinator",
    "build_plan": "hybridflow.pipeline.plan.planner",
    "Plan": "hybridflow.pipeline.plan.planner",
    "Launcher": "hybridflow.pipeline.runtime.launcher",
    "LocalLauncher": "hybridflow.pipeline.runtime.launcher",
    "ProcessSpec": "hybridflow.pipeline.runtime.launcher",
    "register_source": "hybridflow.pipeline.sources.registry",
    "register_driver_op": "hybridflow.pipeline.driver.registry",
    "register_sink": "hybridflow.pipeline.observe.metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:  # PEP 562
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridflow.pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

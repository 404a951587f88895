"""Code that never finishes, named by the deadline and signal tests' topologies: imported
by a stage process (`tests.pipeline.stuck_fns:deadlocked_reward`, the launcher puts the
repo root on the child's PYTHONPATH) or by a `hybridflow run` subprocess (driver op)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

_never = threading.Event()


def deadlocked_reward(prompts, responses, prompt_ids, response_ids, metadata):
    """A reward function stuck forever (as on a lock its own thread already holds)."""
    _never.wait()
    return [0.0] * len(responses)


def long_driver_op(batch, params):
    """A driver op that takes an hour: touches params["touch"] first to say it started."""
    Path(str(params["touch"])).write_text("started")
    deadline = time.monotonic() + 3600
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return {"slow_out": batch["rewards"]}, {}

"""Helpers for runtime tests over real stage processes: a small synthetic topology with
short liveness settings, a launcher that remembers its pids, and a leak check for
processes, shared memory and ipc directories of one run id. Imported by name (`from pipeline_helpers import ...`);
conftest.py holds only fixtures, so no test imports `conftest` (whose name clashes
between test folders)."""

from __future__ import annotations

import copy
import glob
import os
import signal
import tempfile
import threading
from typing import Any

from hybridflow.pipeline.runtime.launcher import LocalLauncher

SYN = "synthetic"


def small_topology(tmp_path: Any, **run: Any) -> dict[str, Any]:
    """rollout -> reward -> actor over 3 processes, 8 micro-batches of 2 samples a step."""
    cost = {"ms_per_sample": 1.0, "work": "sleep"}
    return copy.deepcopy(
        {
            "name": "rt",
            "run_dir": str(tmp_path / "run"),
            "run": {"steps": 2, "step_batch": 16, "micro_batch": 2, **run},
            "data": {"fields": ["sample_idx", "prompt_ids"]},
            "stages": {
                "rollout": {"roles": {"rollout": {"backend": SYN, "options": dict(cost)}}},
                "reward": {"roles": {"reward": {"backend": SYN, "options": dict(cost)}}},
                "actor": {
                    "roles": {
                        "actor": {
                            "backend": SYN,
                            "options": {**cost, "expect_ordered": ["update"]},
                        }
                    }
                },
            },
            "dataflow": [
                {
                    "role": "rollout",
                    "op": "generate",
                    "inputs": ["sample_idx", "prompt_ids"],
                    "outputs": ["response_ids"],
                    "phase": "rollout",
                },
                {
                    "role": "reward",
                    "op": "score",
                    "inputs": ["sample_idx", "response_ids"],
                    "outputs": ["rewards"],
                    "phase": "reward",
                },
                {
                    "role": "actor",
                    "op": "update",
                    "inputs": ["sample_idx", "response_ids", "rewards"],
                    "phase": "train",
                },
                {"role": "actor", "op": "optimizer_step", "scope": "step", "phase": "train"},
                {
                    "role": "actor",
                    "op": "reshard",
                    "scope": "step",
                    "outputs": ["weights"],
                    "phase": "reshard",
                },
                {
                    "role": "rollout",
                    "op": "load_weights",
                    "scope": "step",
                    "inputs": ["weights"],
                    "phase": "reshard",
                },
            ],
            "liveness": {
                "heartbeat_interval_s": 0.2,
                "heartbeat_timeout_s": 5.0,
                "startup_timeout_s": 60.0,
                "shutdown_timeout_s": 2.0,
            },
            "metrics": {"backends": ["jsonl", "memory"]},
        }
    )


class RecordingLauncher(LocalLauncher):
    """LocalLauncher that keeps the pids it started (stop() forgets them)."""

    def __init__(self) -> None:
        super().__init__()
        self.started: dict[str, int] = {}

    def start(self, specs):  # type: ignore[no-untyped-def]
        super().start(specs)
        self.started = self.pids()


class StepSignal:
    """A metrics sink that sets an event when step `at` is written (a test-side seam)."""

    def __init__(self, at: int = 0) -> None:
        self.at = at
        self.event = threading.Event()
        self.rows: list[tuple[int, dict[str, float]]] = []

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append((step, metrics))
        if step >= self.at:
            self.event.set()

    def close(self) -> None:
        pass


def alive(pid: int) -> bool:
    """Exists at all: a zombie is a leak too (nobody reaped it)."""
    return os.path.exists(f"/proc/{pid}")


def leftovers(run_id: str, pids: dict[str, int] | list[int]) -> list[str]:
    """Processes, shm segments and ipc dirs of `run_id` that outlived the run."""
    out = []
    for pid in pids.values() if isinstance(pids, dict) else pids:
        if alive(pid):
            out.append(f"process {pid}")
    out += glob.glob(f"/dev/shm/hybridflow-{run_id}-*")
    out += glob.glob(os.path.join(tempfile.gettempdir(), f"hf-{run_id[:8]}-*"))
    for proc in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(proc, "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if b"hybridflow.pipeline.runtime.launcher" in cmd and run_id.encode() in cmd:
            out.append(f"{proc}: {cmd.decode(errors='replace')}")
    return out


def interruptible() -> None:
    """Popen preexec_fn: SIGINT back to its default in the child. A shell starts a
    background job (`make test &`) with SIGINT ignored, an ignored signal stays ignored
    across exec, and Python then installs no KeyboardInterrupt handler: a Ctrl-C test
    would test nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ppid_and_comm(pid: int) -> tuple[int, str]:
    with open(f"/proc/{pid}/stat") as f:
        head, rest = f.read().rsplit(")", 1)
    return int(rest.split()[1]), head.split("(", 1)[1]


def descendants(root: int) -> dict[int, str]:
    """Every process below `root` -> its comm (stage processes are `hf-<stage>-<replica>`;
    forked ones sit under the fork server, `hf-forkserver`)."""
    tree: dict[int, list[tuple[int, str]]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        pid = int(stat.split("/")[2])
        try:
            ppid, comm = _ppid_and_comm(pid)
        except (OSError, ValueError, IndexError):
            continue
        tree.setdefault(ppid, []).append((pid, comm))
    out, todo = {}, [root]
    while todo:
        for pid, comm in tree.get(todo.pop(), []):
            out[pid] = comm
            todo.append(pid)
    return out


def stage_processes(root: int) -> dict[int, str]:
    """Stage processes below `root` -> "<stage>/<replica>", from their process title."""
    return {
        pid: "/".join(comm[3:].rsplit("-", 1))
        for pid, comm in descendants(root).items()
        if comm.startswith("hf-") and comm != "hf-forkserver"
    }

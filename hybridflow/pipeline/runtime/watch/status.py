"""`<run_dir>/status.json` and `hybridflow status RUN_DIR`: who waits on whom, from another
shell.

The coordinator of the process that holds the run_dir's lock (rundir_lock.py) writes
status.json every heartbeat interval while a job runs, and once more when the job ends:
what it waits for (pipeline/runtime/watch/waiting.py: the same lines the console shows after
`liveness.report_interval_s`, here from the first second), the last finished step and the
job's state. Each write goes to a temporary file renamed over the old one, so a reader
never sees half a document. Only the lock holder writes it: `hybridflow eval` beside a
run leaves the run's status alone.

`hybridflow status RUN_DIR` prints it, after saying whether the run is alive, judged by
the lock file's pid (and that process's start time: a reused pid does not count), since
a killed run cannot say it stopped:

    run 'grpo' (run id 1a2b3c4d5e6f) in runs/grpo: alive, pid 4242 on host1, since ...
    job running: steps 0..9, last finished step 3; status written 0.4s ago
    waiting 62s on stage reward replica 0 (pid 4243) for reward.score step 4 ...

Exit status: 0 when the run is alive, 1 when it is not (or never was), 2 on a bad
argument, so a script can poll it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from hybridflow.errors import ConfigError
from hybridflow.pipeline.runtime.watch.rundir_lock import LOCK_FILE, read_holder
from hybridflow.pipeline.runtime.workers import DaemonExecutor

log = logging.getLogger("hybridflow.status")

STATUS_FILE = "status.json"
VERSION = 1


def write_status(path: Path, doc: dict[str, Any]) -> None:
    """Replace `path` with `doc` atomically (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(json.dumps({"version": VERSION, **doc}, indent=1) + "\n")
    os.replace(tmp, path)


class StatusBoard:
    """Writes status.json off the event loop, one write at a time, in its own daemon thread
    (not the io thread, which a slow data source may hold: the status matters most then);
    an update while the last write is still running is skipped, not queued. With `path`
    None (this process does not hold the run_dir's lock) it writes nothing."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._thread = DaemonExecutor("coordinator-status") if path is not None else None
        self._pending: Future[None] | None = None
        self._warned = False

    def update(self, doc: dict[str, Any]) -> None:
        if self.path is None or self._thread is None:
            return
        if self._pending is not None and not self._pending.done():
            return
        self._pending = self._thread.submit(self._write, self.path, doc)

    def close(self, doc: dict[str, Any]) -> None:
        """The last write (the job's end state), then the thread stops."""
        if self.path is None or self._thread is None:
            return
        self._thread.shutdown(wait=False, cancel_futures=True)
        if self._pending is not None:  # so that an older document cannot land after this one
            with contextlib.suppress(Exception):
                self._pending.result(timeout=1.0)
        self._write(self.path, doc)

    def _write(self, path: Path, doc: dict[str, Any]) -> None:
        try:
            write_status(path, doc)
        except OSError as exc:  # a full disk must not end the run; say it once
            if not self._warned:
                self._warned = True
                log.warning("cannot write %s: %s (hybridflow status will be stale)", path, exc)


def read_status(run_dir: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((run_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _find(run_dir: Path) -> Path:
    """`run_dir`, or the nearest directory above it with a lock file (an Engine's log_dir
    holds the lock for its jobs' run dirs under it: log_dir/sft, log_dir/generate)."""
    real = run_dir.absolute()
    for d in (real, *real.parents):
        if (d / LOCK_FILE).exists():
            return d
    return real


def describe(run_dir: Path, now: float | None = None) -> tuple[bool, list[str]]:
    """(alive, the lines `hybridflow status` prints) for `run_dir`."""
    now = time.time() if now is None else now
    where = _find(run_dir)
    holder = read_holder(where)
    doc = read_status(where)
    name = f" {doc.get('topology', '')!r} (run id {doc.get('run_id', '?')})" if doc else ""
    lines: list[str] = []
    if not (where / LOCK_FILE).exists():
        lines.append(f"{str(run_dir)!r} holds no hybridflow run (no {LOCK_FILE} in it or above)")
        return False, lines
    if holder is None:
        alive = False
        lines.append(f"run{name} in {where}: not running (the last run released the lock)")
    else:
        state = holder.alive()
        alive = state is not False
        if state is None:
            text = f"held by {holder.describe()}; another host: cannot check it from here"
        elif state:
            text = f"alive, {holder.describe()}"
        else:
            text = (
                f"not alive: {holder.describe()} has exited without releasing its lock "
                "(killed or crashed); the status below is its last"
            )
        lines.append(f"run{name} in {where}: {text}")
    if doc is None:
        lines.append("no status written yet (the run is starting, or is not the lock holder)")
        return alive, lines
    age = max(0.0, now - float(doc.get("updated", now)))
    job = f"job {doc.get('state', '?')}"
    if doc.get("steps"):
        job += f": steps {doc['steps']}"
    if doc.get("last_step") is not None:
        job += f", last finished step {doc['last_step']}"
    lines.append(f"{job}; status written {age:.1f}s ago")
    if doc.get("error"):
        lines.append(f"error: {doc['error']}")
    found = doc.get("waits") or []
    lines += [str(w.get("line", "")) for w in found if isinstance(w, dict)]
    if not found and doc.get("state") == "running":
        lines.append("waiting on nothing")
    return alive, lines


def cli_status(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError("RUN_DIR", f"{str(run_dir)!r} is not a directory")
    alive, lines = describe(run_dir)
    with contextlib.suppress(BrokenPipeError):
        print("\n".join(lines))
    return 0 if alive else 1

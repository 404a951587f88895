"""Process placement behind a small interface: start specs, watch them, stop them.

`Launcher` is the seam between the coordinator and wherever stage processes run. The
`LocalLauncher` starts one process per spec on this host, never a fork of the caller:
nothing of the parent's state survives, so CUDA works; and unlike multiprocessing's
spawn, the parent's `__main__` is never re-imported, so any script may start a run
without an `if __name__ == "__main__"` guard. On Linux each is a fork of this process's
fork server (host/forkserver.py: a fresh interpreter that did the ~8 s of torch and
transformers imports once); with HYBRIDFLOW_FORKSERVER=0, or if the server fails, a
fresh interpreter per spec (fork+exec). A
multi-host launcher (on an existing cluster engine) implements the same four methods;
the coordinator never learns which.

Invariants of the LocalLauncher:
  - the payload reaches the child as JSON on its stdin: plain data, nothing executable;
    the run's secret (and its CurveZMQ keys, installed by the child's bootstrap for every
    socket of the process) travels there too, never in argv, the environment or a file;
  - the child runs `python -P`: the working directory is not on its sys.path;
  - a child never outlives this process: PR_SET_PDEATHSIG(SIGKILL) is armed first thing
    in the child, which then checks the parent did not die before that (the stage also
    watches its parent pid in its heartbeat loop); a forked child is tied so to the fork
    server, and the server to this process;
  - children ignore SIGINT: Ctrl-C in a terminal reaches the whole process group, and
    the coordinator alone decides the teardown order;
  - `stop()` is idempotent and escalates: wait (the caller sent Shutdown already) ->
    SIGTERM -> SIGKILL, then reaps every child, so nothing is left, not even a zombie;
  - a child shows as `hf-<stage>-<replica>` in `ps -o comm` / top (/proc/<pid>/comm);
    a fresh one as `python -P -m hybridflow.pipeline.runtime.launcher <stage>/<replica>
    <run_id>` in `ps aux`, a forked one with the fork server's command line
    (`... hybridflow.pipeline.host.forkserver ...`), whose `comm` is `hf-forkserver`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hybridflow.pipeline.host import forkserver

log = logging.getLogger(__name__)

_CHILD_MODULE = "hybridflow.pipeline.runtime.launcher"


# `init_method` of a replicated stage's processes when the launcher, not the session,
# binds the rendezvous (a multi-host launcher: rank 0's node serves it).
LAUNCHER_RENDEZVOUS = "launcher:"


@dataclass(frozen=True)
class ProcessSpec:
    name: str  # "<stage>/<replica>", unique per run
    target: str  # "module:function" called in the child with `payload`; returns exit code
    payload: dict[str, Any]  # plain data only
    title: str = ""  # short OS-visible name (<= 15 bytes shown), e.g. "hf-reward-0"
    env: dict[str, str] = field(default_factory=dict)  # set in the child before the import
    pass_fds: tuple[int, ...] = ()  # inherited by the child under the same numbers


@dataclass(frozen=True)
class ProcessExit:
    name: str
    pid: int
    exitcode: int | None  # None: still running; < 0: killed by signal -exitcode
    host: str = ""  # where it ran, when a launcher spans hosts ("" = this host)
    reason: str = ""  # a launcher's own account of the exit (e.g. "was lost with its node")

    def describe(self) -> str:
        where = f" on host {self.host}" if self.host else ""
        if self.reason:
            return self.reason + where
        return self._describe() + where

    def _describe(self) -> str:
        if self.exitcode is None:
            return "is running"
        if self.exitcode < 0:
            try:
                sig = signal.Signals(-self.exitcode).name
            except ValueError:
                sig = f"signal {-self.exitcode}"
            return f"was killed by {sig}"
        return f"exited with code {self.exitcode}"


class Launcher(Protocol):
    def start(self, specs: Sequence[ProcessSpec]) -> None:
        """Start every spec; returns once the processes exist (not once they are ready)."""

    def pids(self) -> dict[str, int]: ...

    def poll(self) -> list[ProcessExit]:
        """Every started process that has exited, without blocking."""
        ...

    def stop(self, timeout: float) -> list[ProcessExit]:
        """Make sure every process is gone (wait up to `timeout`, then TERM, then KILL)."""
        ...


class LocalLauncher:
    """One OS process (a fresh interpreter) per spec on this host."""

    def __init__(self, *, use_forkserver: bool | None = None) -> None:
        self._procs: dict[str, Child] = {}
        self._fork = forkserver.enabled() if use_forkserver is None else use_forkserver

    def start(self, specs: Sequence[ProcessSpec]) -> None:
        for spec in specs:
            if spec.name in self._procs:
                raise ValueError(f"process {spec.name!r} started twice")
            self._procs[spec.name] = proc = self._spawn(spec)
            log.debug("started %s pid %d", spec.name, proc.pid)

    def _spawn(self, spec: ProcessSpec) -> Child:
        if self._fork:
            try:
                return fork_child(spec)
            except forkserver.ForkServerError as exc:
                log.warning("%s; starting fresh interpreters instead", exc)
                self._fork = False
        return spawn_child(spec)

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self._procs.items()}

    def poll(self) -> list[ProcessExit]:
        # Popen.poll reaps with waitpid(WNOHANG): cheap enough for a 10 Hz watchdog.
        return [
            ProcessExit(name, p.pid, p.returncode)
            for name, p in self._procs.items()
            if p.poll() is not None
        ]

    def stop(self, timeout: float) -> list[ProcessExit]:
        procs = list(self._procs.items())
        deadline = time.monotonic() + max(0.0, timeout)
        for _, p in procs:
            _wait(p, deadline - time.monotonic())
        for sig_name, method, wait in (("SIGTERM", "terminate", 2.0), ("SIGKILL", "kill", 5.0)):
            alive = [(n, p) for n, p in procs if p.poll() is None]
            if not alive:
                break
            log.warning("%s to %s", sig_name, ", ".join(n for n, _ in alive))
            for _, p in alive:
                getattr(p, method)()
            end = time.monotonic() + wait
            for _, p in alive:
                _wait(p, end - time.monotonic())
        self._procs.clear()
        return [ProcessExit(n, p.pid, p.returncode) for n, p in procs]


class Child(Protocol):
    """What the LocalLauncher needs of a started process: a `subprocess.Popen`, or a
    child of the fork server (`forkserver.ForkedProcess`)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def _child_env(spec: ProcessSpec, drop_env: Sequence[str] = ()) -> dict[str, str]:
    # The child imports the same hybridflow as this process, wherever it came from.
    root = str(Path(__file__).resolve().parents[3])  # the dir holding hybridflow/
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    env.update(spec.env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _header(spec: ProcessSpec) -> dict[str, Any]:
    return {
        "target": spec.target,
        "payload": spec.payload,
        "parent_pid": os.getpid(),
        "title": spec.title,
    }


def fork_child(spec: ProcessSpec) -> forkserver.ForkedProcess:
    """Start the child of `spec` as a fork of this process's fork server (its imports
    already done; see host/forkserver.py). Raises ForkServerError if the server fails."""
    # cwd: a fresh child starts in this process's directory now, not the server's.
    env, cwd = _child_env(spec), os.getcwd()
    return forkserver.shared().spawn(_header(spec), env, cwd=cwd, pass_fds=spec.pass_fds)


def spawn_child(
    spec: ProcessSpec, *, cwd: str | None = None, drop_env: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """Start the child of `spec` from this process (its parent: PDEATHSIG ties the child
    to it) and hand it its header on stdin. The one way a stage process is started, by
    the LocalLauncher here and by the Ray launcher's per-process actor on its node.
    `drop_env`: variables of this process the child must not inherit."""
    env = _child_env(spec, drop_env)
    run = str(spec.payload.get("run_id", ""))
    # -P: no working directory on sys.path, so a `json.py` where the run was started
    # is never imported in place of the real one (PYTHONPATH still applies).
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", _CHILD_MODULE, spec.name, run],
        stdin=subprocess.PIPE,
        env=env,
        cwd=cwd,
        close_fds=True,
        pass_fds=spec.pass_fds,
    )
    header = _header(spec)
    assert proc.stdin is not None
    try:
        proc.stdin.write(json.dumps(header).encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass  # the child died at once; its launcher's poll() reports it
    return proc


def _wait(p: Child, seconds: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(max(0.0, seconds))


# ---------------------------------------------------------------------------------------
# In the child: `python -m hybridflow.pipeline.runtime.launcher NAME RUN_ID` with JSON on stdin


def _child_main() -> None:
    header = json.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    forkserver.run_child(header)


if __name__ == "__main__":
    _child_main()

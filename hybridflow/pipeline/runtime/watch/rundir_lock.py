"""One run per directory: an advisory lock on `run_dir` and `checkpoint.save_dir`.

    with lock_dirs([("run_dir", run_dir), ("checkpoint.save_dir", save_dir)], "hybridflow run"):
        ...  # the run: metrics, checkpoints, status.json

Each directory gets a lock file (`hybridflow.lock`) held with `fcntl.flock(LOCK_EX |
LOCK_NB)` for the run's life. The OS releases a flock when its holder dies (kill -9
included), so a stale lock is taken over by the next run with no cleanup step; the file
itself stays (deleting a lock file races with a process opening it). What the file holds
is for people and for `hybridflow status`: the holder's pid, host, process start time and
command, as one JSON object, written after the lock is taken and cleared on release. A
second run on a held directory gets a ConfigError (exit 2) naming the directory's key,
the holder's pid and what it is.

Why this is needed: two runs on one run_dir both started, the second's checkpointer
deleted the first's in-progress save, both appended to metrics.jsonl, and the survivor
exited 0 with corrupt lines.

Invariants: the lock file is opened O_CLOEXEC, so stage processes (fork+exec) never hold
it; a flock belongs to an open file, so a second lock of the same directory in the same
process is refused like any other (an Engine and a CLI run in one interpreter, two
Engines on one log_dir), except that `lock_dirs` takes a directory named twice (run_dir
== save_dir) once. `held_here(path)` says which directory this process holds at or above
`path`: only the holder of a run's lock writes its status.json (pipeline/runtime/watch/status.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridflow.errors import ConfigError
from hybridflow.transport.liveness import pid_alive

LOCK_FILE = "hybridflow.lock"

# resolved directory -> the lock this process holds on it (weak: a lock dropped unreleased,
# as by an Engine garbage-collected without close(), releases itself in __del__)
_held: weakref.WeakValueDictionary[Path, DirLock] = weakref.WeakValueDictionary()
_held_guard = threading.RLock()  # re-entrant: __del__ may run inside a guarded block


@dataclass(frozen=True)
class Holder:
    """What a lock file says about the process holding (or last holding) it."""

    pid: int
    host: str
    started: float  # unix time the lock was taken
    proc_start: str  # /proc/<pid>/stat start time (clock ticks since boot); "" off Linux
    command: str

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host}, since {when} ({self.command})"

    def alive(self) -> bool | None:
        """Whether the holder still runs; None when that cannot be known from here (it
        runs on another host). A pid reused by another process does not count: the
        process start time must match the one recorded."""
        if self.host != socket.gethostname():
            return None
        if not pid_alive(self.pid):
            return False
        return not self.proc_start or _proc_start(self.pid) == self.proc_start


def _proc_start(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: starttime


def read_holder(directory: Path, name: str = LOCK_FILE) -> Holder | None:
    """The holder a directory's lock file names (None: no file, or it was released)."""
    try:
        text = (Path(directory) / name).read_text()
        doc = json.loads(text) if text.strip() else None
        if doc is None:
            return None
        return Holder(
            pid=int(doc["pid"]),
            host=str(doc["host"]),
            started=float(doc["started"]),
            proc_start=str(doc.get("proc_start", "")),
            command=str(doc.get("command", "")),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


class DirLock:
    """The lock of one directory (see the module docstring). `key` is the config key that
    named the directory, for the error message; `name` the lock file's (a job that may
    run beside the directory's run, such as `hybridflow eval`, takes a lock of its own)."""

    def __init__(
        self, directory: Path | str, key: str, command: str, *, name: str = LOCK_FILE
    ) -> None:
        self.directory = Path(directory)
        self.key = key
        self.command = command
        self.name = name
        self._fd: int | None = None
        self._real = self.directory.absolute().resolve()

    @property
    def path(self) -> Path:
        return self.directory / self.name

    def acquire(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConfigError(
                self.key,
                f"cannot create the lock file {str(self.path)!r}: {exc.strerror or exc}; "
                "choose a writable directory",
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(
                    self.key, f"cannot lock {str(self.path)!r}: {exc.strerror or exc}"
                ) from exc
            raise self._in_use() from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(self._me()) + "\n").encode(), 0)
        self._fd = fd
        if self.name == LOCK_FILE:
            with _held_guard:
                _held[self._real] = self

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with _held_guard:
            if _held.get(self._real) is self:
                del _held[self._real]
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # still ours: nobody reads a released holder as alive
        os.close(fd)  # closing releases the flock

    def __enter__(self) -> DirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # an Engine dropped without close(): the OS would anyway
        with contextlib.suppress(Exception):
            self.release()

    def _me(self) -> dict[str, object]:
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "proc_start": _proc_start(os.getpid()),
            "command": self.command,
        }

    def _in_use(self) -> ConfigError:
        holder = None
        for _ in range(20):  # the holder writes its name just after taking the lock
            holder = read_holder(self.directory, self.name)
            if holder is not None:
                break
            time.sleep(0.01)
        who = holder.describe() if holder is not None else "a process that has not named itself"
        if holder is not None and holder.pid == os.getpid():
            who += ", this very process"
        return ConfigError(
            self.key,
            f"{str(self.directory)!r} is in use by another run: {who} holds "
            f"{str(self.path)!r}; wait for it to end, or give this run its own directory "
            "(two runs on one directory delete each other's checkpoints and interleave "
            "their metrics)",
        )


@contextlib.contextmanager
def lock_dirs(dirs: Sequence[tuple[str, Path]], command: str = "") -> Iterator[list[DirLock]]:
    """Hold the lock of every (key, directory) for the block; a directory given twice is
    locked once. All or none: a refused lock releases the ones already taken."""
    locks = take_locks(dirs, command)
    try:
        yield locks
    finally:
        release_all(locks)


def take_locks(dirs: Sequence[tuple[str, Path]], command: str = "") -> list[DirLock]:
    """The locks of `dirs`, taken (see `lock_dirs`); the caller releases them."""
    command = command or " ".join(["hybridflow", *sys.argv[1:3]])
    taken: list[DirLock] = []
    seen: set[Path] = set()
    try:
        for key, directory in dirs:
            real = Path(directory).absolute().resolve()
            if real in seen:
                continue
            seen.add(real)
            lock = DirLock(directory, key, command)
            lock.acquire()
            taken.append(lock)
    except BaseException:
        release_all(taken)
        raise
    return taken


def release_all(locks: Sequence[DirLock]) -> None:
    for lock in reversed(locks):
        lock.release()


def held_here(path: Path | str) -> Path | None:
    """The directory at or above `path` whose lock this process holds, else None."""
    real = Path(path).absolute().resolve()
    with _held_guard:
        for d in (real, *real.parents):
            if d in _held:
                return d
    return None

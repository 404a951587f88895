"""How a stage process comes to be: its bootstrap, and a fork server that skips the imports.

A fresh interpreter spends most of a stage's start importing: on the 2-core CPU machine
`import torch` takes ~2 s and transformers' modeling modules another ~4 s (they pull in
torch.distributed.tensor and dynamo), ~8 s of wall time per process, and far more when
several start at once on two cores. The test suite starts hundreds of stage processes.

The fork server is one fresh interpreter (`python -P -m hybridflow.pipeline.host.forkserver`,
started like any stage process, so CUDA was never initialised in it) that imports
`PRELOAD` once and then forks a child per request. A forked child holds those modules
already; everything else about it is what a fresh interpreter would get:
  - the environment and working directory of the request (the launcher's, with the spec's
    variables), its stdout/stderr, and the spec's `pass_fds` under the same numbers: the
    descriptors travel over the server's socket as SCM_RIGHTS, so a test capturing
    output, or a stage handed its listening socket, sees no difference;
  - `run_child` below, the same bootstrap a fresh interpreter runs: SIGINT ignored,
    PR_SET_PDEATHSIG, the process title, the CurveZMQ keys, then the target.

Lifetimes: the server dies with the process that started it (PR_SET_PDEATHSIG, armed
from a thread that lives as long as that process: the signal follows the creating
*thread*), and each child dies with the server. The server reaps its children and reports
each exit code over the socket; `ForkedProcess` turns those reports into the part of
`subprocess.Popen` the launcher uses (pid, poll, wait, terminate, kill, returncode).

One server per process, started on first use and shared by every run of that process.
It is used by the LocalLauncher on Linux unless HYBRIDFLOW_FORKSERVER=0; any failure to
start or reach it falls back to a fresh interpreter per stage, with a warning. What differs
from a fresh interpreter: the preloaded modules are the versions imported when the server
started, and so are the environment variables they read at import (the thread count,
OMP_NUM_THREADS, is applied per child: `_threads`); `ps aux` shows
the server's command line for its children (their `comm`, `hf-<stage>-<replica>`, is set
as before).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import fcntl
import importlib
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow.transport import curve

log = logging.getLogger(__name__)

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1
_MODULE = "hybridflow.pipeline.host.forkserver"
_LEN = struct.Struct("!I")
_MAX_FDS = 64

# What every stage process imports anyway, heaviest first. A module that fails to import
# is skipped: the child imports it itself (and fails there, with its own error).
PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.mistral.modeling_mistral",
    "zmq",
    "msgspec",
    "hybridflow.pipeline.host.stage_process",
)


# ---------------------------------------------------------------------------------------
# The bootstrap of every stage process, forked or fresh


def run_child(header: Mapping[str, Any]) -> None:
    """Tie this process to its parent, set its title and keys, call the target, exit.
    Never returns. `header`: target ("module:function"), payload, parent_pid, title."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != header["parent_pid"]:  # the parent died before PDEATHSIG was armed
        os._exit(1)
    if header.get("title"):
        set_process_name(header["title"])
    payload = header["payload"]
    # The run's CurveZMQ keys (transport/curve.py), if its sockets leave loopback: installed
    # for every socket of this process, and kept out of the target's payload.
    keys = payload.pop("curve", None) if isinstance(payload, dict) else None
    if keys:
        curve.install(curve.CurveKeys.from_payload(keys))
    module, func = header["target"].split(":")
    code = 1
    try:
        code = int(getattr(importlib.import_module(module), func)(payload) or 0)
    except BaseException:
        logging.getLogger("hybridflow.stage").exception("stage process failed")
    finally:
        # Like multiprocessing's children, leave with os._exit: the target released its
        # resources itself (roles, sockets, shm), and interpreter finalization of the
        # native libraries (zmq, torch) was seen to spin forever now and then.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def set_process_name(title: str) -> None:
    """The name shown by `ps -o comm`, `top` and /proc/<pid>/comm (Linux keeps 15 bytes)."""
    _prctl(_PR_SET_NAME, ctypes.create_string_buffer(title.encode()[:15]))


_libc: Any = None


def _prctl(option: int, arg: Any) -> None:
    global _libc
    if not sys.platform.startswith("linux"):
        return
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        log.warning("prctl(%d) failed: errno %d", option, ctypes.get_errno())


# ---------------------------------------------------------------------------------------
# Framing on the server's socket: a 4-byte length, then JSON; descriptors ride the length.


def _send(sock: socket.socket, obj: Any, fds: Sequence[int] = ()) -> None:
    body = json.dumps(obj).encode()
    socket.send_fds(sock, [_LEN.pack(len(body))], list(fds))
    sock.sendall(body)


def _recv(sock: socket.socket) -> tuple[Any, list[int]] | None:
    """One message and the descriptors that came with it; None at end of stream."""
    head, fds, _, _ = socket.recv_fds(sock, _LEN.size, _MAX_FDS)
    if not head:
        return None
    while len(head) < _LEN.size:  # a stream may split even 4 bytes
        more = sock.recv(_LEN.size - len(head))
        if not more:
            return None
        head += more
    (n,) = _LEN.unpack(head)
    body = bytearray()
    while len(body) < n:
        chunk = sock.recv(n - len(body))
        if not chunk:
            return None
        body += chunk
    return json.loads(body), fds


# ---------------------------------------------------------------------------------------
# The server: `python -P -m hybridflow.pipeline.host.forkserver PARENT_PID FD`


def _serve(sock: socket.socket) -> None:
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05)
        for pid, status in _reap(children):
            _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if not ready:
            continue
        msg = _recv(sock)
        if msg is None:  # the client went away; our children die with us (PDEATHSIG)
            return
        req, fds = msg
        sys.stdout.flush()
        sys.stderr.flush()
        with warnings.catch_warnings():
            # Python 3.12 warns on fork with several OS threads; the one besides ours is
            # torch's, started at import and idle (as when a DataLoader forks its workers,
            # the common case this server is like). Nothing of ours runs in it.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            _child(sock, req, fds)
        children.add(pid)
        for fd in fds:
            os.close(fd)
        _send(sock, {"pid": pid})


def _reap(children: set[int]) -> list[tuple[int, int]]:
    out = []
    for pid in list(children):
        with contextlib.suppress(ChildProcessError):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                continue
            out.append((done, status))
        children.discard(pid)
    return out


def _child(sock: socket.socket, req: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the process the request describes, then bootstrap."""
    try:
        sock.close()
        # fds: stdout, stderr, then pass_fds in order. Move them above every target number
        # first, so that placing one never overwrites another still to be placed.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in fds]
        for fd in fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, target in zip(high, [1, 2, *req["pass_fds"]], strict=True):
            os.dup2(fd, target, inheritable=target > 2)
            os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        if req.get("cwd"):
            os.chdir(req["cwd"])
        # The child must import what a fresh interpreter with this PYTHONPATH would.
        for p in reversed(req["env"].get("PYTHONPATH", "").split(os.pathsep)):
            if p and p not in sys.path:
                sys.path.insert(0, p)
        _threads(req["env"])
        header = dict(req["header"], parent_pid=os.getppid())
        payload = header["payload"]
        # A stage watches the process it is tied to: here, this server.
        if isinstance(payload, dict) and "parent_pid" in payload:
            payload["parent_pid"] = os.getppid()
    except BaseException:
        os._exit(1)
    run_child(header)


# Read once at import by the OpenMP runtime: a forked child would keep the server's
# value. The server starts without them (its own torch default, `_DEFAULT_THREADS`, is what
# a fresh interpreter gets) and each child applies the value of its own environment.
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_DEFAULT_THREADS = 0  # set in the server after preloading


def _threads(env: Mapping[str, str]) -> None:
    """Give this forked child the intra-op thread count a fresh interpreter with `env`
    would have."""
    if "torch" not in sys.modules:
        return
    import torch

    n = _DEFAULT_THREADS
    value = env.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        n = int(value)
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _server_main() -> None:
    global _DEFAULT_THREADS
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides the teardown
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    parent, fd = int(sys.argv[1]), int(sys.argv[2])
    if os.getppid() != parent:
        os._exit(1)
    set_process_name("hf-forkserver")
    sock = socket.socket(fileno=fd)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the child imports it itself, and reports there
            log.debug("forkserver: preload of %s failed: %s", name, exc)
    if "torch" in sys.modules:
        _DEFAULT_THREADS = sys.modules["torch"].get_num_threads()
    _send(sock, {"ready": os.getpid()})
    _serve(sock)
    os._exit(0)


# ---------------------------------------------------------------------------------------
# The client, in the launcher's process


class ForkServerError(RuntimeError):
    """The fork server could not be started or reached."""


class ForkedProcess:
    """A child of the fork server, with the part of `subprocess.Popen` a launcher uses."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.drain(0.0)
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.05 if end is None else min(0.05, end - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            self._server.drain(left)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid the server already reaped
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The client end of one server process (see the module docstring)."""

    def __init__(self, start_timeout_s: float = 120.0) -> None:
        self._lock = threading.RLock()
        self._exits: dict[int, int] = {}
        self._dead = False
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = mine
        started: dict[str, Any] = {}
        ready = threading.Event()
        # PDEATHSIG fires when the creating *thread* exits: start the server from a thread
        # that lives as long as this process, and let it reap the server at the end.
        keeper = threading.Thread(
            target=self._keep, args=(theirs, started, ready), name="hf-forkserver", daemon=True
        )
        keeper.start()
        ready.wait()
        theirs.close()
        if "error" in started:
            mine.close()
            raise ForkServerError(f"cannot start the fork server: {started['error']}")
        self._proc: subprocess.Popen[bytes] = started["proc"]
        mine.settimeout(start_timeout_s)
        try:
            msg = _recv(mine)
        except (OSError, ValueError) as exc:
            msg, started["error"] = None, exc
        if msg is None or "ready" not in msg[0]:
            self.close()
            raise ForkServerError(f"the fork server did not start: {started.get('error')}")
        mine.settimeout(None)

    @staticmethod
    def _keep(theirs: socket.socket, started: dict[str, Any], ready: threading.Event) -> None:
        from pathlib import Path

        root = str(Path(__file__).resolve().parents[3])  # the dir holding hybridflow/
        env = {k: v for k, v in os.environ.items() if k not in _THREAD_ENV}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-P", "-m", _MODULE, str(os.getpid()), str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                env=env,
                close_fds=True,
                pass_fds=(theirs.fileno(),),
            )
        except OSError as exc:
            started["error"] = exc
            ready.set()
            return
        started["proc"] = proc
        ready.set()
        proc.wait()

    @property
    def alive(self) -> bool:
        return not self._dead and self._proc.poll() is None

    def spawn(
        self,
        header: dict[str, Any],
        env: Mapping[str, str],
        *,
        cwd: str | None = None,
        pass_fds: Sequence[int] = (),
    ) -> ForkedProcess:
        req = {"header": header, "env": dict(env), "cwd": cwd, "pass_fds": list(pass_fds)}
        with self._lock:
            if not self.alive:
                raise ForkServerError("the fork server is gone")
            try:
                _send(self._sock, req, [1, 2, *pass_fds])
                while True:  # exit reports may come before our pid
                    msg = self._read()
                    if "pid" in msg:
                        return ForkedProcess(self, int(msg["pid"]))
            except (OSError, ValueError) as exc:
                self._dead = True
                raise ForkServerError(f"the fork server failed: {exc}") from exc

    def drain(self, timeout: float) -> None:
        """Take in the exit reports that arrive within `timeout` seconds."""
        with self._lock:
            if self._dead:
                return
            try:
                while select.select([self._sock], [], [], timeout)[0]:
                    self._read()
                    timeout = 0.0
            except (OSError, ValueError, ForkServerError):
                self._dead = True

    def _read(self) -> dict[str, Any]:
        msg = _recv(self._sock)
        if msg is None:
            self._dead = True
            raise ForkServerError("the fork server closed its socket")
        obj, fds = msg
        for fd in fds:
            os.close(fd)
        if "exit" in obj:
            self._exits[int(obj["exit"])] = int(obj["code"])
        return dict(obj)

    def exit_code(self, pid: int) -> int | None:
        code = self._exits.get(pid)
        if code is None and self._dead and not os.path.exists(f"/proc/{pid}"):
            return -signal.SIGKILL  # the server died first: PDEATHSIG took its children
        return code

    def close(self) -> None:
        """End the server (its running children die with it)."""
        with self._lock:
            self._dead = True
            with contextlib.suppress(OSError):
                self._sock.close()
        with contextlib.suppress(Exception):
            self._proc.wait(5.0)
        if self._proc.poll() is None:
            self._proc.kill()


_shared: ForkServer | None = None
_shared_lock = threading.Lock()


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("HYBRIDFLOW_FORKSERVER") != "0"


def shared() -> ForkServer:
    """This process's fork server, started on first use (and again if it died)."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.alive:
            if _shared is None:
                atexit.register(_close_shared)
            _shared = ForkServer()
        return _shared


def _close_shared() -> None:
    if _shared is not None:
        _shared.close()


if __name__ == "__main__":
    _server_main()

"""Run model-written Python in a separate, limited process: a `python(code)` tool.

    result = run_python("print(6 * 7)", ExecLimits(cpu_s=2, memory_mb=256, wall_s=5))
    result.stdout, result.killed, result.text()      # "42\\n", "", "42"
    python("while True: pass")     # the tool: -> "killed: CPU time limit of 5 s ..."

    env: python                    # ...builtin.python_exec:PythonEnv (a ToolEnv)
    env_options: {cpu_s: 5, memory_mb: 512, wall_s: 10, reward: my.pkg:score}

One call is one fresh process: `python -I -c <launcher>` sets the limits, isolates what the
OS lets it, forks, and the child execs `python -I -c <code>`. The model's program never
shares a process, an interpreter or a working directory with the trainer.

What isolation this gives, exactly (and what it does not):
  - CPU: RLIMIT_CPU = cpu_s seconds per process, then SIGKILL (`killed: "cpu"`).
  - Memory: RLIMIT_AS = memory_mb of address space; an allocation past it fails
    (Python raises MemoryError, shown to the model as its traceback).
  - Wall time: the launcher starts a new session; at wall_s the whole process group is
    SIGKILLed (`killed: "wall"`), so a sleeping or blocked program ends too.
  - Output: stdout and stderr go to files capped by RLIMIT_FSIZE (max_file_bytes; a
    write past it fails with EFBIG instead of killing), and only the first
    max_output_chars of each are shown. Every file the program writes has that cap;
    RLIMIT_NOFILE caps open files at 64; no core dumps.
  - Environment: `-I` (no user site-packages, no PYTHON* variables, no script or working
    directory on sys.path), an environment of PATH/LANG/HOME only, stdin /dev/null,
    the working directory a fresh temporary directory removed afterwards.
  - Network: with `network: "best_effort"` (the default) or `"isolate"`, the launcher
    unshares a new network namespace (only a loopback device that is down: every
    connect fails with "Network is unreachable"). That needs root or unprivileged user
    namespaces (then a user namespace is unshared with it). Where neither is possible,
    "best_effort" runs with the host's network and says so in `network_isolated`;
    "isolate" refuses to run and the tool says why. `"allow"` skips it.
  - Processes: the same unshare gives a new PID namespace: the program is pid 1 of its
    own namespace, cannot address (signal) any process outside it, and every process
    it forks dies with it. Without namespaces it can fork (each child with the same
    limits) and signal its user's processes.
NOT isolated, anywhere: the filesystem (the program runs as the trainer's user, root
included, and reads and writes whatever that user can, within the per-file cap), the
number of processes it forks within its namespace and its time limits, system calls (no
seccomp filter), /proc. This keeps honest mistakes and runaway loops from hurting the
run; it is not a security boundary against adversarial code: run untrusted code in a
container or a sandbox (gVisor, nsjail, firejail), e.g. behind an environment service
(hybridflow env-serve), and keep this tool for code you would run yourself.

Invariants: `run_python` never raises for what the code does (limits, crashes, output
size all land in the ExecResult); it returns within wall_s plus a moment (the process
group is killed at wall_s); the temporary directory is gone when it returns.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridflow.errors import ConfigError
from hybridflow.stages.env.tool_env import ToolEnv

__all__ = ["ExecLimits", "ExecResult", "PythonEnv", "make_python_tool", "python", "run_python"]

Network = Literal["best_effort", "isolate", "allow"]
REFUSED_EXIT = 97  # the launcher's exit code when network: isolate cannot be had

# Runs as `python -I -c LAUNCHER <params json> <code>` in the new session. Fixed code,
# parameters as JSON: nothing of the model's is interpreted here.
LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys
p = json.loads(sys.argv[1])
os.set_inheritable(p["status_fd"], False)  # the program must not reach (or spoof) it
status = os.fdopen(p["status_fd"], "w", buffering=1)
NEWNET, NEWPID, NEWIPC, NEWUSER = 0x40000000, 0x20000000, 0x08000000, 0x10000000
libc = ctypes.CDLL(None, use_errno=True)
flags = NEWPID | NEWIPC | (0 if p["network"] == "allow" else NEWNET)
ns = libc.unshare(flags) == 0 or libc.unshare(NEWUSER | flags) == 0
if not ns and p["network"] == "isolate":
    status.write("refused\n")
    sys.exit(97)
for kind, value in ((resource.RLIMIT_CPU, p["cpu_s"]), (resource.RLIMIT_AS, p["as_bytes"]),
                    (resource.RLIMIT_FSIZE, p["fsize"]), (resource.RLIMIT_CORE, 0),
                    (resource.RLIMIT_NOFILE, 64)):
    resource.setrlimit(kind, (value, value))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # kept across exec: a write past the cap fails
status.write(f"ready {int(ns and p['network'] != 'allow')} {int(ns)}\n")
pid = os.fork()
if pid == 0:
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the launcher's death ends the program
    os.execv(sys.executable, [sys.executable, "-I", "-c", sys.argv[2]])
_, st, ru = os.wait4(pid, 0)
cpu = ru.ru_utime + ru.ru_stime
if os.WIFSIGNALED(st):
    status.write(f"signal {os.WTERMSIG(st)} {cpu}\n")
else:
    status.write(f"exit {os.WEXITSTATUS(st)} {cpu}\n")
"""


@dataclass(frozen=True)
class ExecLimits:
    """The bounds of one run (the tool's and PythonEnv's options of the same names)."""

    cpu_s: int = 5  # CPU seconds per process
    memory_mb: int = 512  # address space
    wall_s: float = 10.0  # the whole run, launch included
    max_output_chars: int = 4000  # of stdout and of stderr, each
    max_file_bytes: int = 1 << 20  # any file the program writes, its output included
    max_code_chars: int = 20000
    network: Network = "best_effort"

    def validate(self, path: str = "env_options") -> None:
        def need(ok: bool, key: str, what: str) -> None:
            if not ok:
                raise ConfigError(f"{path}.{key}", f"{what}, got {getattr(self, key)!r}")

        need(isinstance(self.cpu_s, int) and self.cpu_s >= 1, "cpu_s", "must be an int >= 1")
        need(self.memory_mb >= 64, "memory_mb", "must be >= 64 (the interpreter needs ~30)")
        need(0 < self.wall_s < float("inf"), "wall_s", "must be > 0 seconds")
        need(self.max_output_chars >= 100, "max_output_chars", "must be >= 100")
        need(self.max_file_bytes >= 4096, "max_file_bytes", "must be >= 4096")
        need(self.max_code_chars >= 1, "max_code_chars", "must be >= 1")
        need(
            self.network in ("best_effort", "isolate", "allow"),
            "network",
            "must be one of best_effort, isolate, allow",
        )


@dataclass(frozen=True)
class ExecResult:
    """One run. `killed`: "" | "cpu" | "wall" | "signal" (another signal, e.g. SIGSEGV) |
    "refused" (network: isolate and no namespace) | "code" (not run: too long or with a
    NUL character; `stderr` says which)."""

    stdout: str
    stderr: str
    exit_code: int | None  # None when killed by a signal or never run
    killed: str = ""
    signal: int | None = None
    cpu_s: float = 0.0
    wall_s: float = 0.0
    network_isolated: bool = False
    pid_isolated: bool = False
    truncated: bool = False  # some output was cut to max_output_chars
    limits: ExecLimits = field(default_factory=ExecLimits)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.killed

    def text(self) -> str:
        """What the model reads: stdout alone when it ran cleanly, else stdout, stderr and
        what ended it."""
        if self.ok and not self.stderr:
            return self.stdout if self.stdout else "(no output)"
        parts = [self.stdout] if self.stdout else []
        if self.stderr:
            parts.append(f"stderr:\n{self.stderr}")
        parts.append(self._ending())
        return "\n".join(p.rstrip("\n") for p in parts)

    def _ending(self) -> str:
        lim = self.limits
        if self.killed == "cpu":
            return f"killed: CPU time limit of {lim.cpu_s} s exceeded"
        if self.killed == "wall":
            return f"killed: wall-time limit of {lim.wall_s:g} s exceeded"
        if self.killed == "signal":
            return f"killed by signal {_signame(self.signal)}"
        if self.killed == "refused":
            return "not run: network isolation is not available on this host (network: isolate)"
        if self.killed == "code":
            return "not run"
        return f"exit code {self.exit_code}"


def _signame(sig: int | None) -> str:
    try:
        return signal.Signals(sig).name if sig is not None else "?"
    except ValueError:
        return str(sig)


def run_python(code: str, limits: ExecLimits | None = None) -> ExecResult:
    """Run `code` under `limits` (module docstring) and return what happened."""
    lim = limits or ExecLimits()
    if len(code) > lim.max_code_chars:
        why = f"the code has {len(code)} characters; at most {lim.max_code_chars}"
        return ExecResult("", why, None, killed="code", limits=lim)
    if "\x00" in code:
        return ExecResult("", "the code contains a NUL character", None, killed="code", limits=lim)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(
        prefix="hybridflow-python-", ignore_cleanup_errors=True
    ) as tmp:
        work = os.path.join(tmp, "work")
        os.mkdir(work)
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        r, w = os.pipe()
        params = {
            "status_fd": w,
            "cpu_s": lim.cpu_s,
            "as_bytes": lim.memory_mb << 20,
            "fsize": lim.max_file_bytes,
            "network": lim.network,
        }
        env = {"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work}
        try:
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-c", LAUNCHER, json.dumps(params), code],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    cwd=work,
                    env=env,
                    start_new_session=True,
                    pass_fds=(w,),
                )
            os.close(w)
            w = -1
            timed_out = _wait(proc, lim.wall_s - (time.monotonic() - t0))
            with os.fdopen(r, "r") as status_file:
                r = -1
                status = status_file.read().split()
        finally:
            for fd in (r, w):
                if fd >= 0:
                    os.close(fd)
        stdout, cut_out = _read(out_path, lim.max_output_chars)
        stderr, cut_err = _read(err_path, lim.max_output_chars)
    return _result(status, timed_out, stdout, stderr, cut_out or cut_err, lim, t0)


def _wait(proc: subprocess.Popen[bytes], left_s: float) -> bool:
    """Wait up to `left_s`; past it SIGKILL the session's process group. Timed out?"""
    try:
        proc.wait(timeout=max(0.0, left_s))
        return False
    except subprocess.TimeoutExpired:
        # ProcessLookupError: it ended between the timeout and the kill
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return True


def _read(path: str, max_chars: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(4 * max_chars + 4)  # utf-8: at most 4 bytes a character
    text = data.decode("utf-8", errors="replace")
    if len(text) > max_chars or len(data) > 4 * max_chars:
        return text[:max_chars] + "...(truncated)", True
    return text, False


def _result(
    status: list[str],
    timed_out: bool,
    stdout: str,
    stderr: str,
    truncated: bool,
    lim: ExecLimits,
    t0: float,
) -> ExecResult:
    """The launcher's status lines ("ready NET PID", then "exit N CPU" | "signal N CPU",
    or "refused") and the parent's view of the clock -> an ExecResult."""
    common: dict[str, Any] = {"truncated": truncated, "limits": lim}
    common["wall_s"] = time.monotonic() - t0
    if status[:1] == ["refused"]:
        return ExecResult(stdout, stderr, None, killed="refused", **common)
    if status[:1] == ["ready"] and len(status) >= 3:
        common["network_isolated"], common["pid_isolated"] = status[1] == "1", status[2] == "1"
        status = status[3:]
    if timed_out:
        return ExecResult(stdout, stderr, None, killed="wall", signal=signal.SIGKILL, **common)
    if len(status) < 3:  # the launcher died before it reported (it should not)
        return ExecResult(stdout, stderr, None, killed="signal", **common)
    kind, value, cpu = status[0], int(status[1]), float(status[2])
    common["cpu_s"] = cpu
    if kind == "exit":
        return ExecResult(stdout, stderr, value, **common)
    # RLIMIT_CPU's SIGKILL (soft = hard) or SIGXCPU: told apart from other kills by the
    # CPU the program used
    hit_cpu = value in (signal.SIGKILL, signal.SIGXCPU) and cpu >= lim.cpu_s - 0.05
    return ExecResult(
        stdout, stderr, None, killed="cpu" if hit_cpu else "signal", signal=value, **common
    )


def make_python_tool(limits: ExecLimits | None = None) -> Callable[[str], str]:
    """The `python(code)` tool under `limits`: its result (or what stopped it) as text."""
    lim = limits or ExecLimits()
    lim.validate()

    def python(code: str) -> str:
        """Run a Python program in a fresh process and return what it printed.

        Args:
            code: A complete Python program; print() what you want to see.
        """
        return run_python(code, lim).text()

    return python


python = make_python_tool()  # the default limits: `tools: [...python_exec:python]`


class PythonEnv(ToolEnv):
    """ToolEnv(tools=[python]) with the run limits as options; `tool_timeout_s`
    defaults to wall_s + 10 (the launch included), so the limit, not the tool's
    timeout, ends a long run and its process group is killed."""

    def __init__(
        self,
        *,
        cpu_s: int = 5,
        memory_mb: int = 512,
        wall_s: float = 10.0,
        max_output_chars: int = 2000,
        max_file_bytes: int = 1 << 20,
        network: Network = "best_effort",
        reward: Any = None,
        max_turns: int = 4,
        parser: str = "hermes",
        max_calls_per_turn: int = 2,
        tool_timeout_s: float | None = None,
        reward_timeout_s: float = 30.0,
        failure_score: float = 0.0,
        ground_truth_key: str = "reward_model.ground_truth",
    ) -> None:
        limits = ExecLimits(
            cpu_s=cpu_s,
            memory_mb=memory_mb,
            wall_s=wall_s,
            max_output_chars=max_output_chars,
            max_file_bytes=max_file_bytes,
            network=network,
        )
        limits.validate("env_options")
        super().__init__(
            [make_python_tool(limits)],
            reward=reward,
            max_turns=max_turns,
            parser=parser,
            max_calls_per_turn=max_calls_per_turn,
            tool_timeout_s=tool_timeout_s if tool_timeout_s is not None else wall_s + 10.0,
            max_result_chars=max_output_chars * 2 + 200,
            reward_timeout_s=reward_timeout_s,
            failure_score=failure_score,
            ground_truth_key=ground_truth_key,
        )

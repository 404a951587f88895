"""An environment in a process of its own, owned by the rollout stage (`env_process: true`):
for environments too heavy, too crash-prone or too GIL-bound to share the stage's process.

    rollout options: {env: pkg.mod:HeavyEnv, env_options: {...}, env_process: true}

The stage starts `python -m hybridflow env-serve ENV --options JSON --protocol zmq --port 0
--parent-pid <stage pid>` (service/server.py) on loopback, waits for its "listening on
ADDRESS" line (bounded by `startup_timeout_s`), and talks to it as `env: remote` does
(client.py: sessions, idempotent step ids). The child dies with the stage (it arms
PR_SET_PDEATHSIG on Linux and checks that its parent is the pid it was given); `close`
terminates it, then kills it after `grace_s`.

Failures are named: a child that exits or stays silent at startup is a ConfigError
with its output; one found dead at the start of a generate call is an EnvServiceError
naming its address and exit code; one that dies during a call makes that call an
EnvServiceError when the client's bound (0.9 x env_timeout_s) runs out.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

from hybridflow.errors import ConfigError, EnvServiceError

__all__ = ["EnvProcess"]

READY = "hybridflow env-serve: listening on "


class EnvProcess:
    def __init__(self, proc: subprocess.Popen[str], address: str, reader: threading.Thread) -> None:
        self.proc, self.address, self._reader = proc, address, reader

    @classmethod
    def start(
        cls,
        env: str,
        options: Mapping[str, Any],
        *,
        call_timeout_s: float,
        startup_timeout_s: float = 120.0,
        path: str = "",
    ) -> EnvProcess:
        cmd = [
            sys.executable,
            "-m",
            "hybridflow",
            "env-serve",
            env,
            "--options",
            json.dumps(dict(options)),
            "--protocol",
            "zmq",
            "--port",
            "0",
            "--call-timeout-s",
            str(call_timeout_s),
            "--parent-pid",
            str(os.getpid()),
        ]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:  # the child's output, line by line, until it closes
            assert proc.stdout is not None
            with proc.stdout:  # drained to the end (the child never blocks on it), closed
                for line in proc.stdout:
                    lines.put(line)
            lines.put(None)

        reader = threading.Thread(target=read, name="hybridflow-env-process-out", daemon=True)
        reader.start()
        seen: list[str] = []
        key = f"{path}.env_process" if path else "env_process"
        while True:
            try:
                line = lines.get(timeout=startup_timeout_s)
            except queue.Empty:
                cls(proc, "", reader).close()
                raise ConfigError(
                    key,
                    f"the environment process for {env!r} did not report ready within "
                    f"{startup_timeout_s:g} s; its output: {''.join(seen)[-2000:]!r}",
                ) from None
            if line is None:
                code = proc.wait()
                reader.join()
                raise ConfigError(
                    key,
                    f"the environment process for {env!r} exited with {code} at startup; "
                    f"its output: {''.join(seen)[-2000:]}",
                )
            seen.append(line)
            if line.startswith(READY):
                return cls(proc, line[len(READY) :].strip(), reader)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check(self) -> None:
        """EnvServiceError if the child has exited (its address and exit code named)."""
        code = self.proc.poll()
        if code is not None:
            raise EnvServiceError(
                f"the environment process serving {self.address} exited with {code}",
                url=self.address,
                status="unreachable",
            )

    def close(self, grace_s: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(grace_s)  # it closes the pipe at the child's EOF

"""Where the project's Triton kernels run (the native engine's decode kernels, the
chunked head log-prob's): one check, so every kernel module agrees.

The CPU build of torch comes without triton, so every kernel module imports triton only
`if TRITON:` and keeps a torch path beside its kernels; `runs_on(device)` says which one
a call takes.

Importing triton is not enough: it builds a C launcher for every kernel, so a GPU machine
without a C compiler (a slim CUDA runtime image) fails at the first launch, inside a
rollout or a training step, where the kernels are on by default. `runs_on` therefore
builds and runs one trivial kernel per device first; if that fails it warns once, with
the cause, and every kernel module takes its torch path there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

try:  # an installed but broken triton counts as absent: the torch paths run
    import triton
    import triton.language as tl

    TRITON = True
except ImportError:
    TRITON = False

log = logging.getLogger(__name__)


def runs_on(device: torch.device) -> bool:
    """True where Triton kernels run: triton is installed, the device is CUDA (or
    TRITON_INTERPRET=1 runs them on the CPU, for checks by hand), and a probe kernel
    built and ran there (module docstring)."""
    if not TRITON or (device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        return False
    return builds(device)


class Probe:
    """A capability of this machine's device type, checked once and kept: `check(device)`
    says why it fails (None: it works); a failure is logged once, as `says % (device type,
    why)`, on `logger`. Keyed by type, not by GPU: what fails is the toolchain, and the key
    needs no CUDA call, so a kept answer is a dict lookup where a per-layer dispatch asks
    it (paged_attention.unsupported)."""

    def __init__(
        self,
        check: Callable[[torch.device], str | None],
        says: str,
        logger: logging.Logger = log,
    ) -> None:
        self.check, self.says, self.logger = check, says, logger
        self.answers: dict[str, str | None] = {}

    def __call__(self, device: torch.device) -> bool:
        key = device.type
        if key not in self.answers:
            if torch.compiler.is_compiling() or (
                key == "cuda" and torch.cuda.is_current_stream_capturing()
            ):
                # never launch a probe into a graph being traced or captured: eager runs
                # come first, so this is a first use inside one; its own launch tells
                return True
            why = self.answers[key] = self.check(device)
            if why is not None:
                self.logger.warning(self.says, key, why)
        return self.answers[key] is None


def _probe(device: torch.device) -> str | None:
    try:
        x = torch.arange(8, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
        _copy[(1,)](x, y, 8, BLOCK=8)
        if not torch.equal(x, y):
            return "a probe kernel's copy came back wrong"
    except Exception as e:  # a compiler missing, a driver too old, ...: reported by builds
        return failure(e)
    return None


builds = Probe(
    _probe,
    "Triton cannot build kernels on %s (%s): hybridflow's Triton kernels (decode, sampling, "
    "the head's log-probs) run their torch paths there, slower",
)
"""Whether a trivial Triton kernel builds and runs on a device's type (module docstring)."""


def failure(e: BaseException) -> str:
    """One line for a kernel's build or compile failure. Triton and inductor put the cause
    on the line after their first ("backend='inductor' raised:"), and hints after that,
    so the first two lines that say something are kept."""
    said = [line.strip() for line in str(e).splitlines() if line.strip()][:2]
    return f"{type(e).__name__}: {' | '.join(said)}"


if TRITON:

    @triton.jit
    def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.arange(0, BLOCK)
        keep = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=keep), mask=keep)

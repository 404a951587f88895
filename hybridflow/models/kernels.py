"""Where the project's Triton kernels run (the native engine's decode kernels, the
chunked head log-prob's): one check, so every kernel module agrees.

The CPU build of torch comes without triton, so every kernel module imports triton only
`if TRITON:` and keeps a torch path beside its kernels; `runs_on(device)` says which one
a call takes.
"""

from __future__ import annotations

import os

import torch

try:  # an installed but broken triton counts as absent: the torch paths run
    import triton  # noqa: F401

    TRITON = True
except ImportError:
    TRITON = False


def runs_on(device: torch.device) -> bool:
    """True where Triton kernels run: triton is installed and the device is CUDA (or
    TRITON_INTERPRET=1 runs them on the CPU, for checks by hand)."""
    return TRITON and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")

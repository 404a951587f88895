"""What the runner hands one stage process: a typed `LaunchSpec`, decoded once in the child
from the plain data its bootstrap received (JSON on stdin, or through the fork server).

The session (pipeline/runtime/session.py) writes these keys; an unknown key or a wrong type
fails the child's start naming the field (msgspec), instead of a `KeyError` deep in setup.
The run's secret travels beside the spec and is taken out first (`decode`), so it is never
part of an object that code may log or keep.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["LaunchSpec", "decode"]


class LaunchSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One stage replica's start: which one, where its coordinator is, what it resumes."""

    topology: dict[str, Any]  # the run's Topology as plain data (config.loader.to_dict)
    stage: str
    replica: int
    endpoint: str  # the coordinator's ROUTER
    run_id: str
    run_dir: str
    parent_pid: int  # the launching process (or the fork server's parent): watched
    init_method: str = ""  # tcp:// rendezvous of the stage's replicas; "" with one replica
    init_listen_fd: int = -1  # replica 0: the rendezvous's listening socket, inherited
    resume_dir: str = ""  # a checkpoint to restore right after setup; "" for a fresh start
    # Disaggregated reshard (weight_sync.py): source role -> the endpoints the runner
    # allocated for its link (and, for the sending replica, the fds of their sockets).
    weight_sync: dict[str, dict[str, str | int]] = {}


def decode(payload: dict[str, Any]) -> tuple[LaunchSpec, bytes]:
    """-> (the spec, the run's secret). Raises msgspec.ValidationError naming a bad field."""
    data = dict(payload)
    secret = bytes.fromhex(str(data.pop("secret", "")))
    return msgspec.convert(data, LaunchSpec), secret

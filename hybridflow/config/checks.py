"""Value checks and size bounds shared by the topology's sections (schema.py and the
section modules beside it). Every check raises a `ConfigError` whose path is the dotted
key and whose text says what is wrong and what would be right."""

from __future__ import annotations

import math
import re

from hybridflow.errors import ConfigError

NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]{0,63}$")  # run and stage names
IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")  # role, op and value names
DEVICE = re.compile(r"^(cpu|cuda:\d+)$")
HOST = re.compile(r"^[A-Za-z0-9_.:-]*$")


def require(cond: bool, path: str, message: str) -> None:
    if not cond:
        raise ConfigError(path, message)


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def at_least(value: float, low: float, path: str) -> None:
    require(value >= low, path, f"must be >= {low}, got {value}")


def positive(value: float, path: str) -> None:
    require(value > 0, path, f"must be > 0, got {value}")


def at_most(value: float, high: float, path: str, why: str) -> None:
    require(value <= high, path, f"must be <= {high}, got {value} ({why})")


def finite_positive(value: float, path: str) -> None:
    require(0 < value < math.inf, path, f"must be a finite number of seconds > 0, got {value}")


# Upper bounds on sizes the runtime allocates for (a step's samples, its micro-batch
# table, queues): a typo such as `step_batch: 1000000000000` must fail at validate, not
# grow the coordinator's memory until the machine swaps.
MAX_STEP_BATCH = 1 << 20  # samples per step
MAX_MICRO_BATCHES = 1 << 16  # micro-batches per step (step_batch / micro_batch)
MAX_INFLIGHT = 1024  # tasks queued or running per stage replica
MAX_HWM = 1 << 16  # messages queued per socket
MAX_OFFPOLICY_STEPS = 1024  # steps in flight at once

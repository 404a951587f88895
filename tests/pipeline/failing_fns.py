"""Code that raises what is not an `Exception`, named by the failure tests' topologies:
imported by a stage process (`tests.pipeline.failing_fns:...` reward functions, the
launcher puts the repo root on the child's PYTHONPATH) or by the coordinator (a data
source, a driver op). Each stands for a real case: torch's `CheckpointException` derives
from `BaseException`, a library's generator can leak `GeneratorExit`, and a library can
call `sys.exit` or raise `KeyboardInterrupt` from its own code."""

from __future__ import annotations

import sys
from typing import Any

import torch


class Abort(BaseException):
    """A BaseException subclass that is not an Exception (as CheckpointException is)."""


def abort_reward(prompts, responses, prompt_ids, response_ids, metadata):
    raise Abort("the reward function's own BaseException")


def generator_exit_reward(prompts, responses, prompt_ids, response_ids, metadata):
    raise GeneratorExit("a generator closed under the reward function")


def system_exit_reward(prompts, responses, prompt_ids, response_ids, metadata):
    sys.exit("a library called sys.exit")


def exiting_driver(batch: dict[str, torch.Tensor], params: dict[str, Any]) -> Any:
    """A driver op (in the coordinator's compute thread) that calls sys.exit."""
    raise SystemExit(7)


class InterruptingSource:
    """A data source whose `batch` raises KeyboardInterrupt at step `options["at"]` (in
    the coordinator's io thread: no signal, just code). Registered by the test."""

    def __init__(self, fields: tuple[str, ...], options: dict[str, Any], seed: int) -> None:
        self.fields, self.at = fields, int(options.get("at", 0))

    def batch(self, step: int, size: int) -> dict[str, torch.Tensor]:
        if step >= self.at:
            raise KeyboardInterrupt(f"the data source's own KeyboardInterrupt at step {step}")
        return {
            "sample_idx": torch.arange(step * size, (step + 1) * size),
            "prompt_ids": torch.ones(size, 4, dtype=torch.int64),
        }

    def close(self) -> None:
        pass

"""Helpers for the weight-sync tests: disaggregated topologies over tiny HF models, the
greedy output of a given policy computed in this process, and a leak check."""

from __future__ import annotations

import copy
import glob
import os
from pathlib import Path
from typing import Any

import torch

from hybridflow.stages.base import StageContext
from hybridflow.stages.rollout.hf import HFRollout

ACTOR_SEED = 11  # the actor's initial weights ...
ROLLOUT_SEED = 22  # ... differ from the rollout's until weights move
MAX_NEW = 6
LIVENESS = {
    "heartbeat_interval_s": 0.2,
    "heartbeat_timeout_s": 20.0,
    "startup_timeout_s": 90.0,
    "shutdown_timeout_s": 3.0,
}


def disaggregated(tmp_path: Path, *, steps: int = 2, k: int = 0, **actor: Any) -> dict[str, Any]:
    """trainer: actor (hf tiny) | gen: rollout (hf tiny, greedy), weights stream trainer -> gen.

    Per step: rollout.generate -> actor.get_logprob -> advantages = 1 (arith driver op)
    -> actor.update -> optimizer_step -> actor.reshard + rollout.load_weights (no inputs:
    the disaggregated link)."""
    seq = ["prompt_ids", "prompt_mask", "response_ids", "response_mask"]
    return copy.deepcopy(
        {
            "name": "ws",
            "seed": 0,
            "run_dir": str(tmp_path / "run"),
            "run": {"steps": steps, "step_batch": 4, "micro_batch": 4, "max_offpolicy_steps": k},
            "data": {
                "source": "synthetic",
                "fields": ["prompt_ids", "prompt_mask"],
                "options": {"prompt_length": 5, "vocab_size": 40},
            },
            "stages": {
                "trainer": {
                    "roles": {
                        "actor": {
                            "backend": "hf",
                            "options": {
                                "model": "tiny",
                                "init_seed": ACTOR_SEED,
                                "lr": 3e-2,
                                "weight_bucket_mb": 0.02,  # ~20 KB: many buckets
                                **actor,
                            },
                        }
                    }
                },
                "gen": {
                    "roles": {
                        "rollout": {
                            "backend": "hf",
                            "options": {
                                "model": "tiny",
                                "init_seed": ROLLOUT_SEED,
                                "temperature": 0.0,
                                "max_new_tokens": MAX_NEW,
                                "stop_on_eos": False,
                            },
                        }
                    }
                },
            },
            "dataflow": [
                {
                    "role": "rollout",
                    "op": "generate",
                    "inputs": ["prompt_ids", "prompt_mask"],
                    "outputs": ["response_ids", "response_mask", "rollout_logprobs"],
                },
                {"role": "actor", "op": "get_logprob", "inputs": seq, "outputs": ["old_logprobs"]},
                {
                    "role": "driver",
                    "op": "hybridflow.pipeline.driver.expr:arith",
                    "inputs": ["rollout_logprobs", "response_mask"],
                    "outputs": ["advantages"],
                    "params": {"expr": "0.0 * rollout_logprobs + 1.0", "output": "advantages"},
                },
                {"role": "actor", "op": "update", "inputs": [*seq, "advantages", "old_logprobs"]},
                {"role": "actor", "op": "optimizer_step", "scope": "step"},
                {"role": "actor", "op": "reshard", "scope": "step"},
                {"role": "rollout", "op": "load_weights", "scope": "step"},
            ],
            "liveness": dict(LIVENESS),
            "metrics": {"backends": ["memory"]},
            "log_level": "WARNING",
        }
    )


def greedy(seed: int, prompts: dict[str, torch.Tensor], weights: Any = None) -> dict[str, Any]:
    """Greedy output of the tiny policy with init seed `seed` (then `weights`, if given),
    computed here with the same backend the rollout stage runs."""
    role = HFRollout()
    role.setup(
        StageContext(
            stage="probe",
            replica=0,
            device=torch.device("cpu"),
            seed=0,
            run_dir=Path("/nonexistent"),
            options={
                "model": "tiny",
                "init_seed": seed,
                "temperature": 0.0,
                "max_new_tokens": MAX_NEW,
                "stop_on_eos": False,
            },
        )
    )
    if weights is not None:
        role.update_weights(weights, version=0)
    out, _ = role.handle("generate", dict(prompts), {})
    return out


def shm_names(run_id: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(f"/dev/shm/hybridflow-{run_id}-*"))


class ShmProbe:
    """A metrics sink (runs in the coordinator after each step): which shared-memory names
    of the run exist right then. Mid-run, every bucket's segment must already be mapped
    by its receiver (and so unlinked): nothing named may linger between steps."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.seen: list[list[str]] = []

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.seen.append(shm_names(self.run_id))

    def close(self) -> None:
        pass

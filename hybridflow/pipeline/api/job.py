"""The job an Engine runs, as plain data: the builder's declarations (a frozen snapshot),
the compiled step and the training Topology they make, and the Topology of each call.

    DataflowBuilder.build()  ->  Job(declared, compiled, settings, topology)  ->  Engine

Every call of the Engine runs a Topology derived from the training one by typed
replacement: `train` (more steps, another dataset, a validation section), `validate`,
`sft` (its own ops, data source, sizes, and the actor options it changes), `run` (the
given prompts in order, one step). Nothing here starts a process or refers to the
builder: an Engine is built from a Job, and after SFT it runs `job.with_policy(dir)`.

Invariant: every Topology returned here went through the loader's checks again
(`validated`), as if it had been read from a file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.config.fields import SEQUENCE_FIELDS
from hybridflow.config.loader import from_dict, to_dict
from hybridflow.config.schema import (
    NO_METRICS,
    DataConfig,
    OpConfig,
    RunConfig,
    Topology,
    ValidationConfig,
)
from hybridflow.pipeline.api.declared import Declared, training_topology
from hybridflow.pipeline.compiler.ir import CompiledStep
from hybridflow.pipeline.sources.datasets import dataset_source

SFT_OPS = (
    OpConfig(role="actor", op="sft_update", inputs=SEQUENCE_FIELDS, phase="train"),
    OpConfig(role="actor", op="optimizer_step", scope="step", phase="train"),
    OpConfig(role="actor", op="reshard", scope="step", phase="reshard"),
)
LOAD_WEIGHTS = OpConfig(role="rollout", op="load_weights", scope="step", phase="reshard")


def validated(topo: Topology) -> Topology:
    """A Topology made by `dataclasses.replace`, checked as if it had been loaded."""
    return from_dict(Topology, to_dict(topo))


@dataclass(frozen=True)
class SFTJob:
    """An `sft` call's Topology, and what it means for the processes and the policy."""

    topology: Topology
    restart: bool  # other actor options than the training processes have
    lora: bool  # the policy export is an adapter: RL continues from its merged model


@dataclass(frozen=True)
class Job:
    """What an Engine runs (see the module docstring)."""

    declared: Declared
    compiled: CompiledStep
    settings: Mapping[str, Any]  # training_topology's keyword settings (log_dir, ...)
    topology: Topology  # the training topology: what the processes are started with

    @classmethod
    def make(cls, declared: Declared, compiled: CompiledStep, settings: Mapping[str, Any]) -> Job:
        return cls(
            declared, compiled, dict(settings), training_topology(declared, compiled, **settings)
        )

    def with_policy(self, model_dir: str) -> Job:
        """The same job with every role built from the actor's model on `model_dir`."""
        return Job.make(self.declared.with_policy(model_dir), self.compiled, self.settings)

    @property
    def log_dir(self) -> Path:
        return Path(self.settings["log_dir"])

    def extra(self) -> dict[str, Any]:
        """What a checkpoint records of the step: its logic, inputs and outputs."""
        inputs, outputs, logic = self.declared.step
        return {"logic": logic, "inputs": list(inputs), "outputs": list(outputs)}

    def data(self, dataset: Any) -> DataConfig:
        """The training data section reading `dataset` (None: the declared default)."""
        base = self.topology.data
        if dataset is None:
            return base
        source = dataset_source(dataset, self.log_dir)
        return dataclasses.replace(base, options={**base.options, "source": source})

    # -- the Topology of each call ----------------------------------------------------------
    def train_topology(
        self, last_step: int, dataset: Any, validation: ValidationConfig | None
    ) -> Topology:
        """`train` up to step `last_step` (exclusive) on `dataset`, with `validation`."""
        base = self.topology
        return validated(
            dataclasses.replace(
                base,
                run=dataclasses.replace(base.run, steps=last_step),
                data=self.data(dataset),
                validation=validation,
            )
        )

    def validation_topology(self, validation: ValidationConfig) -> Topology:
        return validated(dataclasses.replace(self.topology, validation=validation))

    def sft_topology(
        self,
        dataset: Any,
        steps: int,
        batch_size: int | None,
        actor_overrides: Mapping[str, Any],
    ) -> SFTJob:
        """`sft`: actor.sft_update on (prompt, response) pairs, `actor_overrides` (lr,
        warmup_steps) on top of the actor's options."""
        base = self.topology
        size = batch_size or base.run.step_batch
        overrides = dict(actor_overrides)
        # A LoRA actor's policy export is a PEFT adapter directory, which no role can load
        # as its model: SFT also writes the merged model (`policy/merged`), and RL starts
        # fresh adapters on top of it.
        lora = int(self.declared.actor_options.get("lora_rank", 0) or 0) > 0
        if lora:
            overrides["lora_export_merged"] = True
        hosts = base.role_stage()
        apart = "rollout" in hosts and hosts["rollout"] != hosts["actor"]
        chosen = dataset if dataset is not None else self.declared.dataset
        topo = validated(
            dataclasses.replace(
                base,
                name=f"{base.name}-sft",
                stages=_with_actor_options(base, overrides),
                run=RunConfig(
                    steps=steps,
                    step_batch=size,
                    micro_batch=base.run.micro_batch if size % base.run.micro_batch == 0 else size,
                ),
                data=dataclasses.replace(
                    base.data,
                    source="sft",
                    fields=SEQUENCE_FIELDS,
                    options={
                        "source": dataset_source(chosen, self.log_dir),
                        **self.declared.tokenizer_options(),
                    },
                ),
                # Weights stream to a rollout in another process as after an RL step.
                dataflow=SFT_OPS + ((LOAD_WEIGHTS,) if apart else ()),
                run_dir=str(self.log_dir / "sft"),
            )
        )
        return SFTJob(topo, restart=bool(overrides), lora=lora)

    def run_topology(self, prompts: Sequence[str], step: int) -> Topology:
        """`run`: one step (number `step`) of the logic on `prompts`, in order."""
        base, compiled = self.topology, self.compiled
        n, trains = compiled.samples_per_prompt, compiled.trains
        size = len(prompts) * n
        # The declared streaming unit when it fits (groups whole), else one micro-batch.
        mb = base.run.micro_batch
        mb = mb if size % mb == 0 and mb % n == 0 else size
        return validated(
            dataclasses.replace(
                base,
                name=base.name if trains else f"{base.name}-generate",
                run=dataclasses.replace(base.run, steps=step + 1, step_batch=size, micro_batch=mb),
                data=dataclasses.replace(
                    base.data,
                    options={
                        **base.data.options,
                        "source": dataset_source(list(prompts), self.log_dir),
                        "shuffle": False,  # one epoch of the prompts in order: row i = prompt i
                    },
                ),
                # A training step is logged with the others; a generation leaves no trace.
                metrics=base.metrics if trains else NO_METRICS,
                run_dir=base.run_dir if trains else str(self.log_dir / "generate"),
            )
        )


def _with_actor_options(base: Topology, overrides: Mapping[str, Any]) -> Any:
    """`base.stages` with `overrides` on top of the actor's options."""
    stages = dict(base.stages)
    if not overrides:
        return stages
    name = next(s for s, c in stages.items() if "actor" in c.roles)
    actor = stages[name].roles["actor"]
    roles = {
        **stages[name].roles,
        "actor": dataclasses.replace(actor, options={**actor.options, **overrides}),
    }
    stages[name] = dataclasses.replace(stages[name], roles=roles)
    return stages

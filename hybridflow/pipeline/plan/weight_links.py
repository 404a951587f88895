"""Weight links: which actor `reshard` streams weights to which rollout `load_weights`
in another stage, derived from the topology alone (no setting). Planning (plan.py) uses
them to let the two ops of a link run together in the step barrier; the stage host
(host/weight_sync.py) uses them to connect sender and receivers.

A link exists for a step op `R.load_weights` with **no inputs** hosted by another stage
than a step op `A.reshard`: A's replica 0 sends to every replica of R's stage, over NCCL
when every end is on CUDA, else over pooled shared memory.

Adapter syncs (`adapter_syncs`): a LoRA actor with `lora_sync: adapters` sends its rollouts
the whole model once, then only its adapters (stages/actor_sync.py). Every rollout it feeds
(its colocated `rollout_role`, the targets of its link) must then hold the same adapters
unmerged: the stage host calls their `hold_adapters` after setup, and a backend that cannot
(`takes_adapters` False, or `adapters_unavailable()` naming why: the vllm backend where the
installed vLLM has no LoRA support) is a ConfigError naming the actor's `lora_sync`. Refused,
not merged instead: the option asks for adapter-sized syncs, and silently sending full
weights every step would hide that it does not get them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from hybridflow.config.schema import Topology
from hybridflow.errors import ConfigError
from hybridflow.stages.base import backend_class

Tier = Literal["shm", "nccl", "gloo"]


@dataclass(frozen=True)
class WeightLink:
    """One sending role and every replica that receives from it."""

    source: str  # role whose `reshard` pushes
    source_stage: str
    reshard_op: int  # dataflow index
    targets: tuple[str, ...]  # receiving roles
    load_ops: tuple[int, ...]  # dataflow indices of their `load_weights` ops
    receivers: tuple[tuple[str, str, int], ...]  # (role, stage, replica); NCCL rank = 1 + index
    tier: Tier
    local_too: bool  # the source stage also hosts a rollout role: reshard it in-process too

    @property
    def identities(self) -> tuple[bytes, ...]:
        return tuple(identity(*r) for r in self.receivers)


def identity(role: str, stage: str, replica: int) -> bytes:
    return f"{role}@{stage}/{replica}".encode()


def links(topo: Topology) -> tuple[WeightLink, ...]:
    """The weight links of `topo` (empty when every reshard is colocated or coordinator-fed).
    Raises ConfigError (dotted path) for a `load_weights` without inputs that no reshard
    in another stage can feed, or that several could."""
    where = topo.role_stage()
    reshards = [
        (i, op) for i, op in enumerate(topo.dataflow) if op.scope == "step" and op.op == "reshard"
    ]
    by_source: dict[int, list[int]] = {}
    for i, op in enumerate(topo.dataflow):
        if op.scope != "step" or op.op != "load_weights" or op.inputs:
            continue
        stage = where.get(op.role)
        sources = [j for j, r in reshards if where.get(r.role) not in (None, stage)]
        if not sources:
            same = [j for j, r in reshards if where.get(r.role) == stage]
            hint = (
                f" (dataflow[{same[0]}] {topo.dataflow[same[0]].label} runs in the same stage "
                f"{stage!r}: it hands weights over in process; drop this load_weights)"
                if same
                else "; add one, or feed load_weights from an op's outputs (inputs: [...])"
            )
            raise ConfigError(
                f"dataflow[{i}]",
                f"{op.label} has no inputs, so it receives weights straight from a step op "
                f"`<actor>.reshard` hosted by another stage, and there is none{hint}",
            )
        if len(sources) > 1:
            labels = ", ".join(f"dataflow[{j}] {topo.dataflow[j].label}" for j in sources)
            raise ConfigError(
                f"dataflow[{i}]",
                f"{op.label} could receive weights from several reshard ops ({labels}); keep one",
            )
        by_source.setdefault(sources[0], []).append(i)
    out = []
    for j, loads in by_source.items():
        src = topo.dataflow[j].role
        src_stage = where[src]
        targets = tuple(dict.fromkeys(topo.dataflow[i].role for i in loads))
        receivers = tuple(
            (role, where[role], r)
            for role in targets
            for r in range(topo.stages[where[role]].replicas)
        )
        devices = [topo.stages[src_stage].device_of(0)] + [
            topo.stages[s].device_of(r) for _, s, r in receivers
        ]
        roles = topo.stages[src_stage].roles
        out.append(
            WeightLink(
                source=src,
                source_stage=src_stage,
                reshard_op=j,
                targets=targets,
                load_ops=tuple(loads),
                receivers=receivers,
                tier="nccl" if all(d.startswith("cuda") for d in devices) else "shm",
                local_too=any(
                    backend_class(rc.kind_of(name), rc.backend).receives_weights
                    for name, rc in roles.items()
                    if name != src
                ),
            )
        )
    return tuple(out)


def sync_partners(topo: Topology) -> dict[int, set[int]]:
    """op index -> the ops of its link it must NOT wait for in the step barrier (they run
    together: the sender blocks until the receivers have loaded what it sent)."""
    out: dict[int, set[int]] = {}
    for link in links(topo):
        for i in link.load_ops:
            out.setdefault(i, set()).add(link.reshard_op)
            out.setdefault(link.reshard_op, set()).add(i)
    return out


def describe_links(topo: Topology) -> list[dict[str, Any]]:
    """For `hybridflow validate`: who sends weights to whom, and how."""
    return [
        {
            "from": f"{link.source} ({link.source_stage}/0)",
            "to": [f"{role} ({stage}/{r})" for role, stage, r in link.receivers],
            "tier": link.tier,
        }
        for link in links(topo)
    ]


@dataclass(frozen=True)
class AdapterSync:
    """One LoRA actor whose syncs carry adapters, and the rollout roles holding them."""

    source: str  # the actor role
    targets: tuple[str, ...]  # rollout roles (any stage) that hold its adapters unmerged
    lora: dict[str, Any] = field(default_factory=dict)  # its lora_rank/alpha/target_modules


def adapter_syncs(topo: Topology) -> tuple[AdapterSync, ...]:
    """The actors with `lora_sync: adapters` that reshard, and whom they feed (module
    docstring). Raises ConfigError naming `lora_sync` for a target that cannot hold them."""
    from hybridflow.models.lora import SHAPE_KEYS, LoraOptions

    where = topo.role_stage()
    streamed = {link.source: link.targets for link in links(topo)}
    out = []
    for role in dict.fromkeys(op.role for op in topo.dataflow if op.op == "reshard"):
        stage = where.get(role)
        if stage is None:
            continue
        options = topo.stages[stage].roles[role].options
        if options.get("lora_sync", "merged") != "adapters":
            continue
        local = str(options.get("rollout_role", "rollout"))
        targets: tuple[str, ...] = (local,) if local in topo.stages[stage].roles else ()
        targets += tuple(t for t in streamed.get(role, ()) if t not in targets)
        for t in targets:
            rc = topo.stages[where[t]].roles[t]
            why = _cannot_hold_adapters(backend_class(rc.kind_of(t), rc.backend))
            if why:
                raise ConfigError(
                    f"stages.{stage}.roles.{role}.options.lora_sync",
                    f"adapters needs every rollout it feeds to hold the adapters unmerged, "
                    f"and {t} (backend {rc.backend}, stage {where[t]}) cannot: {why}; use "
                    "lora_sync: merged (full merged weights at every sync) or an hf / native "
                    "rollout",
                )
        defaults = LoraOptions()
        lora = {k: options.get(k, getattr(defaults, k)) for k in SHAPE_KEYS}
        out.append(AdapterSync(role, targets, lora))
    return tuple(out)


def _cannot_hold_adapters(cls: type) -> str | None:
    """Why a rollout backend cannot hold adapters (None: it can): it lacks the capability
    (`takes_adapters`), or has it only where its engine supports LoRA and says why not
    (`adapters_unavailable()`: the vllm backend without vLLM's LoRA support)."""
    if not getattr(cls, "takes_adapters", False):
        return "the backend has no adapter support"
    unavailable = getattr(cls, "adapters_unavailable", None)
    return unavailable() if callable(unavailable) else None

"""Resolve a validated `Topology` into a `Plan`: processes, op dependencies, phases.

Consumes a `Topology` (config/schema.py, already structurally valid) and checks what
needs the registries the config layer may not import: backends (hybridflow.stages), data
sources, driver ops, metrics sinks, the Python callables a role's options name (a function
reward's `function:`, imported as its stage process would import it) and, when asked,
that the devices exist. Produces the
`Plan` the coordinator and launcher work from, and the human/JSON description printed by
`hybridflow validate`.

Dependencies inside one step (what `PlannedOp.deps` means):
  - a micro-batch op depends on the producers of its inputs (per micro-batch for
    micro-batch values, the whole step for step values; data fields are always there);
  - a step op depends on every op listed before it (the step barrier), except that a
    `reshard` streaming weights to another stage and that stage's `load_weights` do not
    wait for each other: they run together (pipeline/host/weight_sync.py).
`head` ops consume only data fields: they start a step's micro-batches (rollout), and
only they may run ahead of the previous step's reshard (`max_offpolicy_steps`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config.imports import load_attr, stage_import_path
from hybridflow.config.loader import config_hash, from_dict
from hybridflow.config.schema import DRIVER_ROLE, OpConfig, Topology
from hybridflow.errors import ConfigError
from hybridflow.stages.base import OpIO

DATA = -1  # producer index of data-source fields


@dataclass(frozen=True)
class PlannedOp:
    index: int
    cfg: OpConfig
    stage: str | None  # None: a driver op, computed in the coordinator
    deps: tuple[int, ...]  # op indices this op waits for within a step
    phase_index: int  # position of cfg.phase_name among the plan's phases
    head: bool  # consumes only data fields
    # Its role's replicas are the ranks of one FSDP group: every task goes to all of them,
    # each with its share of the rows (runtime/scheduler.py).
    sharded: bool = False

    @property
    def is_step(self) -> bool:
        return self.cfg.scope == "step"

    @property
    def label(self) -> str:
        return self.cfg.label


@dataclass(frozen=True)
class ProcessInfo:
    stage: str
    replica: int
    device: str
    roles: tuple[str, ...]
    host: str = ""  # "" = this host; else a node of a multi-host launcher

    @property
    def name(self) -> str:
        return f"{self.stage}/{self.replica}"


@dataclass(frozen=True)
class Plan:
    topology: Topology
    config_hash: str
    ops: tuple[PlannedOp, ...]
    processes: tuple[ProcessInfo, ...]
    phases: tuple[str, ...]
    producer: dict[str, int]  # value name -> op index, DATA for data fields
    role_stage: dict[str, str]

    @property
    def replicas(self) -> dict[str, int]:
        return {name: cfg.replicas for name, cfg in self.topology.stages.items()}

    def role_ops(self, role: str) -> dict[str, OpIO]:
        return role_ops(self.topology, role)

    def nodes(self) -> dict[str, str]:
        """Process name -> host, for the processes `stages.<s>.hosts` puts elsewhere (what
        a multi-host launcher's `assign_nodes` receives)."""
        return {p.name: p.host for p in self.processes if p.host}

    def shared_gpus(self) -> dict[str, tuple[str, ...]]:
        """GPU -> the stage processes on it, for GPUs that host more than one. Legal (a
        user may pack small stages onto one device), but each process has its own CUDA
        allocator and cache: memory one frees is not free for the others, and their
        peaks add up. Roles that share a stage share one process and one allocator."""
        on: dict[str, list[str]] = {}
        for p in self.processes:
            if p.device.startswith("cuda"):
                where = f"{p.host}:{p.device}" if p.host else p.device
                on.setdefault(where, []).append(p.name)
        return {dev: tuple(names) for dev, names in sorted(on.items()) if len(names) > 1}

    def edges(self) -> list[tuple[str, str, str]]:
        """(producer label, consumer label, value) for every value that crosses an op."""
        out = []
        for op in self.ops:
            for name in op.cfg.inputs:
                p = self.producer[name]
                out.append(("data" if p == DATA else self.ops[p].label, op.label, name))
        return out


def role_ops(topo: Topology, role: str) -> dict[str, OpIO]:
    """What a role will be asked to do: op -> inputs/outputs/scope (StageContext.world)."""
    return {
        op.op: OpIO(inputs=tuple(op.inputs), outputs=tuple(op.outputs), scope=op.scope)
        for op in topo.dataflow
        if op.role == role
    }


def build_plan(topo: Topology, *, check_devices: bool = False, check_data: bool = True) -> Plan:
    """Registry checks + dependency analysis. Raises ConfigError with dotted paths.

    The data check builds the data source (which validates its own options) and closes
    it. `check_data=False` leaves that to a caller that builds the run's source from
    `topo.data` itself, so that a run builds it, and tokenizes its prompts, once."""
    sharded = sharded_roles(topo, _check_backends(topo))
    if check_data:
        _check_data(topo)
    from hybridflow.pipeline.observe.metrics import check_sinks

    check_sinks(topo.metrics.backends)
    if check_devices:
        check_devices_exist(topo)
    role_stage = topo.role_stage()
    from hybridflow.pipeline.plan.weight_links import adapter_syncs, sync_partners

    # A reshard streaming to another stage and that stage's load_weights run together.
    partners = sync_partners(topo)
    adapter_syncs(topo)  # every rollout fed adapters can hold them
    producer: dict[str, int] = {name: DATA for name in topo.data.fields}
    phases: list[str] = []
    ops: list[PlannedOp] = []
    for i, cfg in enumerate(topo.dataflow):
        if cfg.role == DRIVER_ROLE:
            from hybridflow.pipeline.driver.registry import resolve_driver_op

            resolve_driver_op(cfg.op, f"dataflow[{i}].op", topology=topo, index=i)
        if cfg.phase_name not in phases:
            phases.append(cfg.phase_name)
        if cfg.scope == "step":
            deps = tuple(j for j in range(i) if j not in partners.get(i, ()))
        else:
            deps = tuple(sorted({producer[n] for n in cfg.inputs} - {DATA}))
        head = cfg.scope == "micro_batch" and all(producer[n] == DATA for n in cfg.inputs)
        ops.append(
            PlannedOp(
                index=i,
                cfg=cfg,
                stage=role_stage.get(cfg.role),
                deps=deps,
                phase_index=phases.index(cfg.phase_name),
                head=head,
                sharded=cfg.role in sharded,
            )
        )
        for name in cfg.outputs:
            producer[name] = i
    processes = tuple(
        ProcessInfo(stage, r, cfg.device_of(r), tuple(cfg.roles), cfg.host_of(r))
        for stage, cfg in topo.stages.items()
        for r in range(cfg.replicas)
    )
    return Plan(
        topology=topo,
        config_hash=config_hash(topo),
        ops=tuple(ops),
        processes=processes,
        phases=tuple(phases),
        producer=producer,
        role_stage=role_stage,
    )


def _check_backends(topo: Topology) -> dict[str, type]:
    """-> role name -> its backend class (imported, not constructed)."""
    from hybridflow.stages import BACKENDS  # imports only the registry, not the backends

    classes: dict[str, type] = {}  # role -> backend class
    for stage, cfg in topo.stages.items():
        for role, rc in cfg.roles.items():
            kind = rc.kind_of(role)
            target = BACKENDS.get((kind, rc.backend)) or BACKENDS.get(("*", rc.backend))
            if target is None:
                known = sorted({b for (k, b) in BACKENDS if k in (kind, "*")})
                raise ConfigError(
                    f"stages.{stage}.roles.{role}.backend",
                    f"unknown backend {rc.backend!r} for role kind {kind!r}; known: {', '.join(known)}",
                )
            # A stage on another host reads its model files there: its launcher's to check.
            local = not any(cfg.host_of(r) for r in range(cfg.replicas))
            classes[role] = _check_role_options(
                target, rc.options, f"stages.{stage}.roles.{role}.options", local=local
            )
    _check_ops(topo, classes)
    return classes


def _check_role_options(
    target: str, options: dict[str, Any], path: str, *, local: bool = True
) -> type:
    """Parse a role's `options:` with its backend's `options_cls` (when it declares one), so
    a typo fails at validate/plan time rather than during stage setup. Imports the backend
    module only (cheap: models and engines are built in `setup`, in the stage process).
    For a stage on this host (`local`), also what the options can check against files
    (`check_plan(path)`, e.g. the native rollout against its model's config) and the
    callable they name. Returns the backend class."""
    cls: type = load_attr(target, path.rsplit(".", 1)[0] + ".backend")
    lora = sorted(k for k in options if k.startswith("lora_"))
    if lora and not getattr(cls, "trainable", False):
        raise ConfigError(
            f"{path}.{lora[0]}",
            f"LoRA trains adapters, and {cls.__name__} trains nothing: put the lora_* "
            "options on a trainable role (actor, critic). A reference colocated with a "
            "LoRA actor already runs on its base weights (share_base); a rollout gets "
            "the merged weights at every reshard",
        )
    options_cls = getattr(cls, "options_cls", None)
    if options_cls is not None:
        opts = from_dict(options_cls, dict(options), path)
        if local:
            check_plan = getattr(opts, "check_plan", None)
            if callable(check_plan):
                check_plan(path)
            _check_named_callable(opts, path)
    return cls


def _check_named_callable(opts: Any, path: str) -> None:
    """Options that name a Python callable for the stage to run declare `target(path)` ->
    its "package.module:function" (the function reward: its `function:` or the module of
    its `scorer:`). Import it now, on the path the stage process will have, so a missing
    module or attribute fails at validate naming its key, not in the stage's setup."""
    target = getattr(opts, "target", None)
    if not callable(target):
        return
    key = f"{path}.scorer" if getattr(opts, "scorer", "") else f"{path}.function"
    with stage_import_path():
        load_attr(target(path), key, callable_only=True, form="package.module:function")


def _check_ops(topo: Topology, classes: dict[str, type]) -> None:
    """Every dataflow op against its role's declaration (stages/contract.py): a typo such
    as `op: generat` fails here, before any process starts, naming `dataflow[i].op`."""
    from hybridflow.stages.contract import RoleBase, check_dataflow_op

    for i, cfg in enumerate(topo.dataflow):
        cls = classes.get(cfg.role)
        if cls is None or not issubclass(cls, RoleBase):
            continue  # the driver, or a third-party backend without declarations
        check_dataflow_op(
            cls,
            op_name=cfg.op,
            scope=cfg.scope,
            inputs=cfg.inputs,
            outputs=cfg.outputs,
            path=f"dataflow[{i}]",
            params=cfg.params,
        )


def role_classes(topo: Topology) -> dict[str, type]:
    """Role name -> its backend class (imported, not constructed), after the checks of
    `build_plan` on backends and ops: what the runtime asks about a role's ops."""
    return _check_backends(topo)


def trainer_stages(topo: Topology) -> set[str]:
    """Stages hosting a trainable role: their checkpointed weights are rank-count free
    (DCP shards, stages/parallel/checkpoint.py), so a resume may change their replicas."""
    classes = _check_backends(topo)
    return {
        stage
        for stage, cfg in topo.stages.items()
        if any(getattr(classes.get(role), "trainable", False) for role in cfg.roles)
    }


def sharded_roles(topo: Topology, classes: dict[str, type]) -> set[str]:
    """Roles whose replicas are the ranks of one sharded model (stages/parallel/): their
    tasks go to every rank, rows split evenly. A trainable role's replicas must be ranks:
    independent copies would train apart (their gradients never exchanged)."""
    out: set[str] = set()
    for stage, cfg in topo.stages.items():
        for role, rc in cfg.roles.items():
            cls = classes.get(role)
            decide = getattr(cls, "sharded", None)
            ranks = bool(decide(rc.options, cfg.replicas)) if callable(decide) else False
            if cfg.replicas > 1 and getattr(cls, "trainable", False) and not ranks:
                raise ConfigError(
                    f"stages.{stage}.roles.{role}.options.fsdp",
                    f"role {role!r} trains on {cfg.replicas} devices; as independent copies "
                    "it would train apart (gradients never exchanged): leave fsdp unset "
                    f"(one model sharded over the devices) or give stage {stage!r} one device",
                )
            if not ranks:
                continue
            out.add(role)
            if cfg.replicas > 1 and topo.run.micro_batch % cfg.replicas:
                raise ConfigError(
                    "run.micro_batch",
                    f"is {topo.run.micro_batch}, which does not split evenly over the "
                    f"{cfg.replicas} ranks of {role!r} (stage {stage!r}); use a multiple "
                    f"of {cfg.replicas}",
                )
    return out


def _check_data(topo: Topology) -> None:
    from hybridflow.pipeline.sources.registry import create_source

    create_source(topo.data, topo.seed).close()  # the source validates its own options


def check_devices_exist(topo: Topology) -> None:
    """The CUDA devices `topo` puts stage replicas on exist on this machine (those of
    other hosts are their launcher's to check); else a ConfigError naming the key."""
    wanted = [  # GPUs of other hosts are their launcher's to check
        (stage, r, cfg.device_of(r))
        for stage, cfg in topo.stages.items()
        for r in range(cfg.replicas)
        if cfg.device_of(r).startswith("cuda") and not cfg.host_of(r)
    ]
    if not wanted:
        return
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for stage, r, dev in wanted:
        if int(dev.split(":")[1]) >= n:
            cfg = topo.stages[stage]
            path = f"stages.{stage}.devices" + ("" if isinstance(cfg.devices, str) else f"[{r}]")
            raise ConfigError(path, f"{dev} is not available: this machine has {n} CUDA device(s)")


# ---------------------------------------------------------------------------------------


def describe(plan: Plan) -> dict[str, Any]:
    """The resolved topology as plain data (`hybridflow validate --json`)."""
    t = plan.topology
    shared = plan.shared_gpus()
    return {
        "name": t.name,
        "config_hash": plan.config_hash,
        "seed": t.seed,
        "run": {
            "steps": t.run.steps,
            "step_batch": t.run.step_batch,
            "micro_batch": t.run.micro_batch,
            "micro_batches_per_step": t.run.micro_batches,
            "mode": t.run.mode,
            "max_offpolicy_steps": t.run.max_offpolicy_steps,
            "max_inflight": t.run.max_inflight,
        },
        "data": {"source": t.data.source, "fields": list(t.data.fields)},
        "processes": [
            {
                "name": p.name,
                "stage": p.stage,
                "replica": p.replica,
                "device": p.device,
                "roles": {r: t.stages[p.stage].roles[r].backend for r in p.roles},
                **({"host": p.host} if p.host else {}),
            }
            for p in plan.processes
        ],
        "ops": [
            {
                "op": op.label,
                "scope": op.cfg.scope,
                "phase": op.cfg.phase_name,
                "runs_on": op.stage or "coordinator",
                "inputs": list(op.cfg.inputs),
                "outputs": list(op.cfg.outputs),
                "head": op.head,
                "sharded": op.sharded,
            }
            for op in plan.ops
        ],
        "edges": [{"from": a, "to": b, "value": v} for a, b, v in plan.edges()],
        **_weight_links(t),
        **({"shared_gpus": {d: list(n) for d, n in shared.items()}} if shared else {}),
    }


def _weight_links(t: Topology) -> dict[str, Any]:
    from hybridflow.pipeline.plan.weight_links import describe_links

    found = describe_links(t)
    return {"weight_sync": found} if found else {}


def describe_text(plan: Plan) -> str:
    d = describe(plan)
    run = d["run"]
    lines = [
        f"topology {d['name']!r}  (config hash {d['config_hash']}, seed {d['seed']})",
        f"run: {run['steps']} step(s) x {run['step_batch']} samples, micro-batch "
        f"{run['micro_batch']} ({run['micro_batches_per_step']} per step), mode {run['mode']}, "
        f"max_offpolicy_steps {run['max_offpolicy_steps']}, max_inflight {run['max_inflight']}",
        f"data: {d['data']['source']} -> {', '.join(d['data']['fields'])}",
        f"processes ({len(d['processes'])}):",
    ]
    width = max(len(p["name"]) for p in d["processes"])
    for p in d["processes"]:
        roles = ", ".join(f"{r} ({b})" for r, b in p["roles"].items())
        host = f"  on host {p['host']}" if "host" in p else ""
        lines.append(f"  {p['name']:<{width}}  device {p['device']:<7} roles: {roles}{host}")
    lines.append(f"dataflow ({len(d['ops'])} ops, phases: {', '.join(plan.phases)}):")
    for i, op in enumerate(d["ops"]):
        scope = "step" if op["scope"] == "step" else "mb  "
        ranks = "  (FSDP: every rank, its share of the rows)" if op["sharded"] else ""
        lines.append(
            f"  [{i}] {scope} {op['op']}({', '.join(op['inputs'])}) -> "
            f"({', '.join(op['outputs'])})  on {op['runs_on']}{ranks}"
        )
    lines.append("edges:")
    for e in d["edges"]:
        lines.append(f"  {e['from']} -> {e['to']}: {e['value']}")
    for w in d.get("weight_sync", []):
        lines.append(f"weights: {w['from']} -> {', '.join(w['to'])} over {w['tier']}")
    from hybridflow.pipeline.plan.step import outline  # it reads this module's Plan

    lines += outline(plan)
    for dev, names in d.get("shared_gpus", {}).items():
        lines.append(
            f"shared GPU: {dev} hosts {len(names)} stage processes ({', '.join(names)}); each "
            "has its own CUDA allocator, so their peaks add up (roles in one stage share one)"
        )
    return "\n".join(lines)

"""Run a topology end to end: launch stages, coordinate, tear down; the CLI entry points.

`run_topology(topo)` is the one way a run happens (CLI, benchmarks, tests, later the
Python API): it binds the coordinator's ROUTER, starts one process per stage replica
through a `Launcher`, runs the `Coordinator` and, whatever happens (success, error,
Ctrl-C, SIGTERM), tears down in this order:
    Shutdown to every stage -> close the socket -> launcher.stop (wait, TERM, KILL,
    reap) -> sweep /dev/shm/hybridflow-<run_id>-* -> remove the ipc directory.
Invariant: when `run_topology` returns or raises, no process and no shared-memory
segment of the run is left.

Checkpoints and resume (pipeline/checkpoint.py): with a `checkpointer` the coordinator
saves after every due step; `resume_dir` + `start_step` continue a run from a
checkpoint (each stage process restores its roles and RNG after setup, and the
scheduler starts at `start_step`: the data source and the samplers are deterministic in
the step number, so the continuation equals the uninterrupted run).

`cli_run` / `cli_validate` back `hybridflow run|validate CONFIG [--set k=v]`; errors
propagate as HybridflowError (the CLI prints one line and exits 2; Ctrl-C exits 130).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hybridflow.config.loader import to_dict
from hybridflow.config.schema import Topology, load_topology
from hybridflow.errors import ConfigError, StageError
from hybridflow.pipeline.checkpoint.store import Checkpointer
from hybridflow.pipeline.compiler.plan import Plan, build_plan, describe, describe_text
from hybridflow.pipeline.host.weight_sync import endpoints
from hybridflow.pipeline.observe.metrics import MetricsSink, make_sinks
from hybridflow.pipeline.runtime.coordinator import Coordinator, RunResult
from hybridflow.pipeline.runtime.launcher import Launcher, LocalLauncher, ProcessSpec
from hybridflow.pipeline.sources.registry import create_source
from hybridflow.transport import shm
from hybridflow.transport.channel import Channel

log = logging.getLogger("hybridflow.runner")

STAGE_ENTRY = "hybridflow.pipeline.host.stage_process:main"


def run_dir_of(topo: Topology) -> Path:
    return Path(topo.run_dir or os.path.join("runs", topo.name))


def run_topology(
    topo: Topology,
    *,
    collect: Sequence[str] = (),
    run_id: str | None = None,
    sinks: Sequence[MetricsSink] = (),
    launcher: Launcher | None = None,
    start_step: int = 0,
    resume_dir: str | None = None,
    checkpointer: Checkpointer | None = None,
) -> RunResult:
    """Run `topo` to completion and return its metrics/events. Raises HybridflowError.

    Runs steps `start_step` .. `topo.run.steps - 1`; `resume_dir` is the checkpoint the
    stages restore from (see the module docstring)."""
    if not 0 <= start_step < topo.run.steps:
        raise ConfigError(
            "run.steps",
            f"must be greater than the step to start at ({start_step}), got {topo.run.steps}",
        )
    plan = build_plan(topo, check_devices=True)
    _honour_log_level(topo.log_level)
    run_id = run_id or uuid.uuid4().hex[:12]
    run_dir = run_dir_of(topo)
    launcher = launcher or LocalLauncher()
    ipc_dir = _ipc_dir(topo, run_id)
    all_sinks = make_sinks(topo.metrics.backends, run_dir, topo, start_step) + list(sinks)
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            terminated: list[bool] = []
            try:
                result = runner.run(
                    _amain(
                        plan,
                        run_id,
                        run_dir,
                        ipc_dir,
                        launcher,
                        all_sinks,
                        tuple(collect),
                        terminated,
                        start_step,
                        resume_dir,
                        checkpointer,
                    )
                )
            except asyncio.CancelledError:
                if terminated:  # SIGTERM: reported like Ctrl-C (the CLI exits 130)
                    raise KeyboardInterrupt("SIGTERM") from None
                raise
    finally:
        result_exits = launcher.stop(topo.liveness.shutdown_timeout_s)
        leaked = shm.sweep(run_id)
        if leaked:
            log.debug("swept %d shm segment(s) of run %s", len(leaked), run_id)
        if ipc_dir:
            shutil.rmtree(ipc_dir, ignore_errors=True)
        for sink in all_sinks:
            with contextlib.suppress(Exception):
                sink.close()
    result.exits = result_exits
    return result


async def _amain(
    plan: Plan,
    run_id: str,
    run_dir: Path,
    ipc_dir: str | None,
    launcher: Launcher,
    sinks: list[MetricsSink],
    collect: tuple[str, ...],
    terminated: list[bool],
    start_step: int = 0,
    resume_dir: str | None = None,
    checkpointer: Checkpointer | None = None,
) -> RunResult:
    topo = plan.topology
    t = topo.transport
    endpoint = f"ipc://{ipc_dir}/coordinator" if ipc_dir else f"tcp://{t.host}:0"
    chan = Channel(
        "router",
        endpoint,
        bind=True,
        name="coordinator",
        run_id=run_id,
        hwm=t.hwm,
        shm_threshold=t.shm_threshold,
    )
    source = create_source(topo.data, topo.seed)
    coord = Coordinator(
        plan,
        chan,
        launcher,
        source,
        sinks,
        run_id=run_id,
        collect=collect,
        start_step=start_step,
        checkpointer=checkpointer,
        resume_dir=resume_dir,
    )
    _cancel_on_sigterm(terminated)
    try:
        launcher.start(_specs(plan, run_id, run_dir, chan.endpoint, resume_dir))
        return await coord.run()
    finally:
        await coord.shutdown("run finished")
        chan.close()
        source.close()


def _honour_log_level(level: str) -> None:
    """The topology's log_level applies to the coordinator too (stages set their own),
    unless the caller already asked for more detail (e.g. `--log-level DEBUG`)."""
    logger = logging.getLogger("hybridflow")
    wanted = logging.getLevelName(level)
    if wanted < logger.getEffectiveLevel():
        logger.setLevel(wanted)


def _specs(
    plan: Plan, run_id: str, run_dir: Path, endpoint: str, resume_dir: str | None = None
) -> list[ProcessSpec]:
    topo_data = to_dict(plan.topology)
    host = plan.topology.transport.host
    # Replicas of one stage are ranks of one group (data parallel / FSDP): give them a
    # rendezvous address so roles never pick ports themselves.
    init = {
        stage: f"tcp://{host}:{_free_port(host)}" for stage, n in plan.replicas.items() if n > 1
    }
    # Stage-to-stage weight links (disaggregated reshard): one endpoint per sending role.
    weight_sync = endpoints(plan.topology, endpoint)
    return [
        ProcessSpec(
            name=p.name,
            target=STAGE_ENTRY,
            payload={
                "topology": copy.deepcopy(topo_data),  # each its own: launchers may edit
                "stage": p.stage,
                "replica": p.replica,
                "endpoint": endpoint,
                "run_id": run_id,
                "run_dir": str(run_dir),
                "parent_pid": os.getpid(),
                "init_method": init.get(p.stage, ""),
                "resume_dir": resume_dir or "",
                "weight_sync": copy.deepcopy(weight_sync),
            },
            title=f"hf-{p.stage}-{p.replica}",
        )
        for p in plan.processes
    ]


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ipc_dir(topo: Topology, run_id: str) -> str | None:
    if topo.transport.protocol != "ipc":
        return None
    base = topo.transport.ipc_dir or None
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"hf-{run_id[:8]}-", dir=base)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _cancel_on_sigterm(terminated: list[bool]) -> None:
    """SIGTERM takes the same teardown path as Ctrl-C (asyncio.Runner handles SIGINT)."""
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    if task is None:
        return

    def on_term() -> None:
        terminated.append(True)
        task.cancel()

    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGTERM, on_term)


# ---------------------------------------------------------------------------------------
# CLI


def _load(args: argparse.Namespace) -> Topology:
    if not args.config:
        raise ConfigError("", "give a config: a YAML file or a preset name")
    return load_topology(args.config, list(getattr(args, "overrides", []) or []))


def cli_validate(args: argparse.Namespace) -> int:
    topo = _load(args)
    plan = build_plan(topo)
    note = ""
    try:
        build_plan(topo, check_devices=True)
    except ConfigError as exc:
        note = f"note: cannot run on this machine: {exc}"
    if getattr(args, "json", False):
        out: dict[str, Any] = describe(plan)
        if note:
            out["note"] = note
        print(json.dumps(out, indent=2))
    else:
        print(describe_text(plan))
        if note:
            print(note)
        print("ok")
    return 0


def cli_run(args: argparse.Namespace) -> int:
    topo = _load(args)
    try:
        result = run_topology(topo)
    except StageError as exc:
        # The CLI prints the error as one line; show the remote traceback above it.
        if exc.remote_traceback:
            print("--- remote traceback ---\n" + exc.remote_traceback.rstrip(), file=sys.stderr)
        raise StageError(
            str(exc).split("\n--- remote traceback ---")[0],
            stage=exc.stage,
            replica=exc.replica,
            step=exc.step,
            mb_id=exc.mb_id,
        ) from None
    last = result.metrics[-1] if result.metrics else {}
    print(
        f"run {topo.name} ({result.run_id}): {len(result.metrics)} step(s) in {result.wall_s:.2f}s "
        f"(+{result.startup_s:.2f}s startup), {result.tasks} tasks; "
        f"last step {last.get('timing/step', 0.0):.3f}s"
    )
    if "jsonl" in topo.metrics.backends:
        print(f"metrics: {run_dir_of(topo) / 'metrics.jsonl'}")
    return 0

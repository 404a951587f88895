"""The coordinator's state machine: which task may run now, and where. No I/O, no asyncio.

Consumes data batches (`add_data`) and task completions (`complete`); produces
`Dispatch`es (`ready()`), finished steps with their metrics (`pop_finished()`) and an
event log (`events`). The coordinator does all the I/O around it, so every ordering rule
below is unit-testable without processes.

A task is (step s, op j, micro-batch m) — or (s, j, -1) for a step op. It is dispatched
when all of these hold (checked in this order, cheapest first):
  1. step s has started: its data is in and `policy_version >= s - max_offpolicy_steps`
     (k = 0: step s starts only after step s-1 finished, i.e. after its reshard);
  2. its inputs exist: producers done for micro-batch m (or for the whole step, for
     values made by step ops); a step op waits for every op listed before it (barrier);
  3. order: micro-batches of an op go out in mb_id order, and step s of an op only after
     step s-1 of that op went out — so train ops see micro-batches in order;
  4. role order across steps: a non-head op of role R in step s waits until R's step ops
     of step s-1 (optimizer step, reshard, weight load) are done. Head ops (rollout) are
     exempt: they are bounded by rule 1 instead — that is what k > 0 buys;
  5. sequential mode: every op of an earlier phase is done for the whole step;
  6. capacity: a micro-batch op goes to the replica of its stage with the fewest tasks in
     flight (ties: lowest index) that has < `max_inflight`; a head op skips replicas with
     a step op in flight (so its `policy_version` stamp is exact); a step op goes to every
     replica at once (each must have room; while it waits, its stage takes no new
     micro-batch work, so a rollout running ahead cannot starve the reshard); driver ops
     (stage None) always have room.
A step op's outputs come from its lowest replica. Steps finish in order; finishing step
s (all its ops done) sets `policy_version = s + 1`.

Sharded ops (`PlannedOp.sharded`: a role whose replicas are the ranks of one FSDP group,
plan/planner.py) go to every rank at once, like step ops, because every rank must run
the same collectives in the same order: each rank gets its contiguous share of the rows
(`shard_rows`; the plan makes micro_batch divisible by the ranks), and the task completes
when all ranks answered, its outputs concatenated in rank order. Its metrics are the
lowest rank's alone: a sharded role reports numbers that are already global (the trainer
all-reduces its sums), so summing or averaging N copies would only distort counters.

Samples (`sample_rows = n > 0`, observe/samples.py): each step picks n rows at its start;
a micro-batch op's undeclared SAMPLE_FIELDS outputs are kept for those rows alone, and a
finished step's rows come out of `pop_samples()` beside its metrics.

Resuming (`start_step = r`): steps r, r+1, ... run as if steps 0..r-1 had finished
(`policy_version = r`). `hold = h` (set by the coordinator while it checkpoints) keeps
steps >= h from starting, so a checkpoint sees every role between two steps.

A step's records (its values per micro-batch, timings, metric sums) and the arithmetic
on its rows (joining micro-batches, slicing step values, sharding) are
pipeline/runtime/steps.py; this module holds the rules alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from hybridflow.errors import PipelineError, StageError
from hybridflow.pipeline.observe.samples import SAMPLE_FIELDS, SampleRow, pick_rows, take_rows
from hybridflow.pipeline.plan.planner import Plan, PlannedOp
from hybridflow.pipeline.runtime.steps import (
    Batch,
    Dispatch,
    Event,
    StepState,
    TaskState,
    concat_rows,
    shard_rows,
)

# Dispatch, Event and the row helpers are the scheduler's vocabulary: importable from here.
__all__ = [
    "DRIVER_REPLICA",
    "Dispatch",
    "Event",
    "Scheduler",
    "concat_rows",
    "shard_rows",
]

DRIVER_REPLICA = -1
MAX_EVENTS = 2_000_000  # ~100 B each: a long run's log stays bounded (recording just stops)


def mark_gangs(sent: list[Dispatch]) -> list[Dispatch]:
    """One op's micro-batches of one step dispatched in one round: those that go to the
    same replica form a gang (Dispatch.gang), which a stage may run as one batch (the hf
    rollout does). A gang is a function of the scheduler's state, not of arrival times:
    at a step's start with nothing in flight (k = 0), every micro-batch of the head op."""
    by: dict[tuple[int, ...], list[Dispatch]] = {}
    for d in sent:
        by.setdefault(d.replicas, []).append(d)
    for group in by.values():
        for d in group:
            d.gang = (group[0].mb_id, len(group))
    return sent


class Scheduler:
    def __init__(
        self,
        plan: Plan,
        *,
        clock: Callable[[], float] = time.perf_counter,
        start_step: int = 0,
    ) -> None:
        run = plan.topology.run
        self.plan = plan
        self.ops = plan.ops
        self.steps_total = run.steps
        self.k = run.max_offpolicy_steps
        self.step_batch, self.micro_batch, self.n_mb = (
            run.step_batch,
            run.micro_batch,
            run.micro_batches,
        )
        self.cap = run.max_inflight
        self.sequential = run.mode == "sequential"
        self.fields = tuple(plan.topology.data.fields)
        self.clock = clock
        self.policy_version = start_step
        self.hold: int | None = None  # steps >= hold may not start (checkpoint in progress)
        self.inflight = {s: [0] * n for s, n in plan.replicas.items()}
        self.step_inflight = {s: [0] * n for s, n in plan.replicas.items()}
        self.events: list[Event] = []
        self.collect: tuple[str, ...] = ()
        self.collected: dict[int, dict[str, list[torch.Tensor]]] = {}
        self.sample_rows = 0  # rows per step kept as samples (observe/samples.py)
        self._samples_out: list[tuple[int, list[SampleRow]]] = []
        self._steps: dict[int, StepState] = {}
        self._data: dict[int, Batch] = {}
        self._requested = start_step  # steps [start, _requested) had their data requested
        self._started = start_step
        self._finished = start_step
        self._finished_out: list[tuple[int, dict[str, float]]] = []
        self._last_finish: float | None = None  # clock time the previous step finished
        self._tasks: dict[int, TaskState] = {}
        self._next_task = 0
        self._reserved: set[str] = set()
        self._op_size = [1 if op.is_step else self.n_mb for op in self.ops]
        self._role_step_ops = {
            op.cfg.role: tuple(o.index for o in self.ops if o.is_step and o.cfg.role == op.cfg.role)
            for op in self.ops
        }
        self._earlier_phase_ops = {
            op.index: tuple(o.index for o in self.ops if o.phase_index < op.phase_index)
            for op in self.ops
        }

    # -- data ----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._finished == self.steps_total

    def data_requests(self) -> list[int]:
        """Steps whose data should be fetched now: up to one step beyond the start gate,
        so the data source works while the previous step still runs."""
        limit = min(self.steps_total, self.policy_version + self.k + 2)
        wanted = list(range(self._requested, limit))
        self._requested = max(self._requested, limit)
        return wanted

    def add_data(self, step: int, batch: Batch) -> None:
        got = sorted(batch)
        if got != sorted(self.fields):
            raise PipelineError(
                f"data source returned fields {got} for step {step}; data.fields says {sorted(self.fields)}"
            )
        for name, t in batch.items():
            if t.dim() == 0 or t.shape[0] != self.step_batch:
                raise PipelineError(
                    f"data source field {name!r} has shape {list(t.shape)} for step {step}; "
                    f"expected {self.step_batch} rows (run.step_batch)"
                )
        self._data[step] = batch

    # -- dispatch --------------------------------------------------------------------------
    def ready(self) -> list[Dispatch]:
        """Start whatever steps may start, then every task that may run now (in-flight
        bookkeeping is updated here: the caller must send each Dispatch)."""
        self._start_steps()
        out: list[Dispatch] = []
        # A step op that is ready but blocked by capacity reserves its stage: no new
        # micro-batch work goes there until it is out (else rollout of a later step could
        # keep a replica busy and starve the reshard).
        self._reserved = set()
        for s in sorted(self._steps):
            st = self._steps[s]
            for op in self.ops:
                j = op.index
                if op.is_step:
                    if st.next_mb[j] == 0 and self._step_op_ready(st, op):
                        d = self._dispatch(st, op, -1)
                        if d is None:
                            self._reserved.add(op.stage or "")
                            continue
                        st.next_mb[j] = 1
                        out.append(d)
                    continue
                sent: list[Dispatch] = []
                while st.next_mb[j] < st.n_mb and self._mb_ready(st, op, st.next_mb[j]):
                    d = self._dispatch(st, op, st.next_mb[j])
                    if d is None:
                        break
                    st.next_mb[j] += 1
                    sent.append(d)
                out += mark_gangs(sent)
        return out

    def _start_steps(self) -> None:
        while (
            self._started < self.steps_total
            and self._started in self._data
            and self.policy_version >= self._started - self.k
            and (self.hold is None or self._started < self.hold)
        ):
            s = self._started
            data = self._data.pop(s)
            st = StepState(s, self.n_mb, len(self.ops), self.clock(), data, ops_left=len(self.ops))
            b = self.micro_batch
            st.mb_values = [
                {k: v[m * b : (m + 1) * b] for k, v in data.items()} for m in range(self.n_mb)
            ]
            if self.sample_rows:
                st.picks = pick_rows(b, self.n_mb, self.sample_rows)
                st.mb_extra = [{} for _ in range(self.n_mb)]
            self._steps[s] = st
            self._started += 1
            self._log(Event(st.t_start, "start", s, -1, -1, -1, self.policy_version))

    def _common_ready(self, st: StepState, op: PlannedOp) -> bool:
        prev = self._steps.get(st.step - 1)
        j = op.index
        if prev is not None:
            if prev.next_mb[j] < (1 if op.is_step else prev.n_mb):
                return False  # rule 3: this op of the previous step has not all gone out
            if not op.head:
                for p in self._role_step_ops[op.cfg.role]:
                    if not prev.done[p]:
                        return False  # rule 4
        if self.sequential:
            for p in self._earlier_phase_ops[j]:
                if st.done[p] < self._op_size[p]:
                    return False  # rule 5
        return True

    def _mb_ready(self, st: StepState, op: PlannedOp, m: int) -> bool:
        for p in op.deps:
            if self.ops[p].is_step:
                if not st.done[p]:
                    return False
            elif not st.mb_done[p][m]:
                return False
        return self._common_ready(st, op)

    def _step_op_ready(self, st: StepState, op: PlannedOp) -> bool:
        for p in op.deps:  # every earlier op (the barrier)
            if st.done[p] < self._op_size[p]:
                return False
        return self._common_ready(st, op)

    def _pick(self, op: PlannedOp) -> tuple[int, ...] | None:
        if op.stage is None:
            return ()
        load = self.inflight[op.stage]
        if op.is_step:
            return tuple(range(len(load))) if max(load) < self.cap else None
        if op.stage in self._reserved:
            return None
        if op.sharded:  # every rank, each with room
            return tuple(range(len(load))) if max(load) < self.cap else None
        busy_step = self.step_inflight[op.stage]
        best = -1
        for r, n in enumerate(load):
            if n >= self.cap or (op.head and busy_step[r]):
                continue
            if best < 0 or n < load[best]:
                best = r
        return None if best < 0 else (best,)

    def _dispatch(self, st: StepState, op: PlannedOp, m: int) -> Dispatch | None:
        replicas = self._pick(op)
        if replicas is None:
            return None
        inputs = st.inputs(self.plan, op, m)
        task_id = self._next_task
        self._next_task += 1
        for r in replicas:
            self.inflight[op.stage][r] += 1  # type: ignore[index]
            if op.is_step:
                self.step_inflight[op.stage][r] += 1  # type: ignore[index]
        self._tasks[task_id] = TaskState(
            st.step, m, op, replicas, set(replicas) or {DRIVER_REPLICA}
        )
        now = self.clock()
        st.phase_t0.setdefault(op.cfg.phase_name, now)
        if op.head:
            st.head_versions.append(self.policy_version)
        rep = replicas[0] if len(replicas) == 1 else -1
        self._log(Event(now, "dispatch", st.step, m, op.index, rep, self.policy_version))
        samples = not op.is_step and any(mb == m for mb, _ in st.picks)
        return Dispatch(task_id, st.step, m, op, replicas, inputs, self.policy_version, samples)

    # -- completion ----------------------------------------------------------------------
    def sent(self, step: int, nbytes: int, seconds: float) -> None:
        """A task of `step` went out: `nbytes` of tensors, `seconds` inside the send."""
        st = self._steps.get(step)
        if st is not None:
            st.transfer["to_stages_mb"] += nbytes / 1e6
            st.transfer["send_s"] += seconds

    def complete(
        self,
        task_id: int,
        replica: int,
        outputs: Batch,
        metrics: dict[str, float],
        compute_s: float = 0.0,
        received_bytes: int = 0,
    ) -> None:
        t = self._tasks.get(task_id)
        if t is None or replica not in t.pending:
            raise PipelineError(f"result for unknown task {task_id} from replica {replica}")
        op, st = t.op, self._steps[t.step]
        st.transfer["from_stages_mb"] += received_bytes / 1e6
        t.pending.discard(replica)
        if op.stage is not None:
            self.inflight[op.stage][replica] -= 1
            if op.is_step:
                self.step_inflight[op.stage][replica] -= 1
        lowest = replica == min(t.replicas, default=DRIVER_REPLICA)
        if lowest or not op.sharded:  # a sharded role's metrics are global (docstring)
            st.add_metrics(metrics)
        phase = op.cfg.phase_name
        st.compute[phase] = st.compute.get(phase, 0.0) + compute_s
        if op.sharded or lowest:
            self._take_outputs(t, replica, outputs)
        now = self.clock()
        self._log(
            Event(now, "done", t.step, t.mb_id, op.index, replica, self.policy_version, compute_s)
        )
        if t.pending:
            return
        del self._tasks[task_id]
        t.outputs = t.joined()
        j = op.index
        if op.is_step:
            st.step_values.update(t.outputs)
            st.done[j] = 1
        else:
            st.mb_values[t.mb_id].update(t.outputs)
            if st.picks:
                st.keep_sample_values(t, self.micro_batch)
            st.mb_done[j][t.mb_id] = True
            st.done[j] += 1
        st.phase_t1[phase] = now
        if st.done[j] == self._op_size[j]:
            st.ops_left -= 1
            if st.ops_left == 0:
                self._finish_in_order()

    def _take_outputs(self, t: TaskState, replica: int, outputs: Batch) -> None:
        """Keep what `replica` returned for task `t`: its declared outputs (all of them, or
        a StageError), and the undeclared sample values of a micro-batch op."""
        op = t.op
        missing = [n for n in op.cfg.outputs if n not in outputs]
        if missing:
            raise StageError(
                f"{op.label} (step {t.step}, micro-batch {t.mb_id}) returned "
                f"{sorted(outputs)}; the dataflow declares outputs {list(op.cfg.outputs)}, "
                f"missing {missing}",
                stage=op.stage or "driver",
                replica=replica,
                step=t.step,
                mb_id=t.mb_id,
            )
        if self.sample_rows and not op.is_step:
            t.raw[replica] = {
                n: v for n, v in outputs.items() if n in SAMPLE_FIELDS and n not in op.cfg.outputs
            }
        if op.sharded:
            t.parts[replica] = {n: outputs[n] for n in op.cfg.outputs}
        else:  # a step op runs on every replica; the lowest speaks for all
            t.outputs = {n: outputs[n] for n in op.cfg.outputs}

    def _finish_in_order(self) -> None:
        while (st := self._steps.get(self._finished)) is not None and st.ops_left == 0:
            now = self.clock()
            metrics = st.metrics(now, self._last_finish, self.policy_version, self.step_batch)
            self._last_finish = now
            if self.collect:
                self.collected[st.step] = st.collect(self.collect)
            if st.picks:
                rows = take_rows(st.picks, st.mb_values, st.mb_extra, self.micro_batch)
                self._samples_out.append((st.step, rows))
            del self._steps[st.step]
            self._finished += 1
            self.policy_version = self._finished
            self._log(Event(now, "finish", st.step, -1, -1, -1, self.policy_version))
            self._finished_out.append((st.step, metrics))

    def _log(self, event: Event) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append(event)

    def pop_finished(self) -> list[tuple[int, dict[str, float]]]:
        out, self._finished_out = self._finished_out, []
        return out

    def pop_samples(self) -> list[tuple[int, list[SampleRow]]]:
        """The sample rows of the steps finished since the last call (module docstring)."""
        out, self._samples_out = self._samples_out, []
        return out

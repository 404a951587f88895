"""The coordinator: drives the steps of one job over stage processes (asyncio, one loop).

Which loop waits for what, and who unblocks it:

    stage processes ==(ROUTER socket)==> recv loop
        Hello      -> Welcome (proof of the run secret, then config hash; the connection
                      is admitted: before that nothing else of it is acted on;
                      admission.py)                              ready set grows
        Heartbeat  -> liveness clock of that replica             "ready" -> all_ready?
        Result     -> scheduler.complete()  --------------------> wake
        Failure    -> StageError (remote traceback; failures.py) -> done (error)

    data tasks     (io thread: DataSource.batch)  -> scheduler.add_data()   -> wake
    driver tasks   (compute thread: driver op)    -> scheduler.complete()   -> wake
                   (the threads: offload.py)

    dispatch loop  waits on `wake`; then: request data, take every ready task from the
                   scheduler (pipeline/runtime/scheduler.py holds all ordering rules),
                   send Tasks / start driver tasks, hand finished steps to the metrics
                   sinks and their sample rows to the sample sinks (io thread: decoding
                   and writing), and resolves `done` after the last step.

    liveness loop  (pipeline/runtime/watch/watchdog.py) every tick: launcher.poll() (a
                   process exited -> StageDeadError) and heartbeat ages
                   (> liveness.heartbeat_timeout_s -> StageDeadError); before all stages
                   are ready, liveness.startup_timeout_s bounds setup; task deadlines: a
                   task running (as the stage's heartbeats report it) longer than its
                   op's bound (pipeline/runtime/watch/deadlines.py), or listed by no
                   heartbeat within liveness.heartbeat_timeout_s of its sending (lost),
                   and a driver op running longer than its bound -> StageError (rules
                   and messages: pipeline/runtime/peers.py).
                   Every heartbeat interval: who waits on whom (pipeline/runtime/watch/
                   waiting.py): a warning line per wait longer than
                   liveness.report_interval_s, once per interval, and status.json in
                   the run_dir this process holds the lock of (runtime/watch/status.py).
    undecodable    a message from a known stage that cannot be decoded while that stage
                   has tasks in flight (the channel's `on_bad_message`) -> StageError:
                   what it carried is lost, and waiting for it would hang.

    checkpoint     (with a Checkpointer) after a due step finished: the scheduler holds
                   the next step (`sched.hold`), every stage process answers a `Control`
                   call `CheckpointSave` (ControlDone within liveness.control_timeout_s;
                   control.py) by writing its part, the io thread commits the directory
                   (pipeline/checkpoint/), the hold moves on -> wake. `done` waits for
                   the last save.

    run()          waits for `done` (result or error); teardown: cancel loops, gather.

One Coordinator runs one job (pipeline/runtime/session.py): the first job of a session
handshakes the stages it launched (Hello checked against the session's config hash); a
later job gets the session's peers, already ready, and starts dispatching at once
(after checking no process died since the last job).

Invariants: the event loop never computes (data sources, driver ops, sinks run in
threads); every wait has a bound named in its error; the first error wins and ends the
run; `policy_version` on every Task is the scheduler's version at dispatch.

Modules: loop.py (the Coordinator and RunResult), admission.py, control.py, offload.py,
failures.py.
"""

from hybridflow.pipeline.runtime.coordinator.control import shutdown_peers
from hybridflow.pipeline.runtime.coordinator.failures import oom_hint
from hybridflow.pipeline.runtime.coordinator.loop import Coordinator, RunResult

__all__ = ["Coordinator", "RunResult", "oom_hint", "shutdown_peers"]

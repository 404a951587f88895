"""Watching a run: the coordinator's liveness loop (watchdog), who owns a run directory
(rundir_lock), how long each op may take (deadlines), what the coordinator waits for
(waiting) and the status.json that `hybridflow status RUN_DIR` reads (status)."""

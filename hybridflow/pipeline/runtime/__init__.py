"""The coordinator side of a run: launching stage processes (launcher), the coordinator's
event loop for one job (coordinator), the pure micro-batch/step state machine
(scheduler), stage liveness (peers), processes kept up across jobs (session) and the
one-shot whole-run driver (runner).
"""

"""The coordinator side of a run: launching stage processes (launcher), the coordinator's
event loop (coordinator), the pure micro-batch/step state machine (scheduler), stage
liveness (peers) and the whole-run driver (runner).
"""

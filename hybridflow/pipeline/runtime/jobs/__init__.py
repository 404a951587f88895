"""The jobs a session runs beyond one training job, each on the run's own processes:

    training.py     run_training: a run's steps as jobs, cut at the validation points
    validation.py   Validator: the held-out validation job (its source read once)
    evaluate.py     `hybridflow eval`: one validation of a checkpoint's policy, no training

Each runs its steps through `Session.run_job` (pipeline/runtime/session.py) on a
session's processes; `hybridflow eval` opens that session itself.
"""

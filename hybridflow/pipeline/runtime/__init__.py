"""The coordinator side of a run: launching stage processes (launcher, ray_launcher) and
what each is started with (stage_specs), the coordinator of one job (coordinator/), the
pure micro-batch/step state machine (scheduler) and a step's records (steps), stage
liveness (peers, watch/), processes kept up across jobs (session), the one-shot whole-run
driver (runner), and the jobs a session runs beyond one training job (jobs/: training cut
at the validation points, the validation job, `hybridflow eval`).
"""

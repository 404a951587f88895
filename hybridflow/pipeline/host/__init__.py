"""The stage side of a run: the process that hosts one stage replica's roles
(stage_process) and the stage-to-stage weight streams of a disaggregated reshard
(weight_sync, weight_stream). Roles never see a socket; this package does.
"""

"""The stage side of a run: the process that hosts one stage replica's roles and the
stage-to-stage weight streams of a disaggregated reshard. Roles never see a socket; this
package does. stage_process (its life: the launch spec, the socket, supervised loops,
teardown), setup (roles built and restored), tasks (what the coordinator asks, run and
answered), worker (the one thread role code runs in), failures (errors -> Failure),
dispatch (the contract's ordering rules), weight_sync / weight_stream (links), forkserver
(how stage processes start).
"""

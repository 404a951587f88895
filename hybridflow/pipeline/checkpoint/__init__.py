"""Checkpoints: the run-level schedule, the stage-level save/load of role state and RNG."""

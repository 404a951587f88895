"""Checkpoints: every stage's role states + RNG, the run's position and config, on disk.

One idea per module:
  layout.py        where a checkpoint's parts lie (the directory diagram), their names
  tree.py          a state tree <-> `<name>.json` + `<name>.safetensors`; nothing pickled
  stage.py         inside a stage process: seeding its RNGs, `save_stage`, `load_stage`,
                   the actor's `policy_weights` for a rollout that resumes
  checkpointer.py  in the coordinator: when to save, the atomic commit, driver op state
  resume.py        before a resume: `resolve` a checkpoint, `read_meta` strictly,
                   `check_files`, the `stage_layout` both runs must share
"""

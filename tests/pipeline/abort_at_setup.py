"""A reward-function module whose import raises a BaseException inside a stage's setup
(the stage's worker thread, `<stage>-<replica>-worker`); imported anywhere else (e.g. a
coordinator that checks the module at plan time) it is a plain module."""

from __future__ import annotations

import threading

from tests.pipeline.failing_fns import Abort

if "-worker" in threading.current_thread().name:
    raise Abort("the reward module's import gave up")


def reward(prompts, responses, prompt_ids, response_ids, metadata):
    return [0.0] * len(responses)

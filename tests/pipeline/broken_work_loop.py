"""A reward-function module that, imported in a stage's setup (the stage's worker thread,
`<stage>-<replica>-worker`), breaks that process's task dispatcher: the narrow seam that
stands for a bug in the stage host's own work loop (every role's error is a Failure of its
task, so no role can kill that loop). Imported anywhere else it is a plain module."""

from __future__ import annotations

import threading

if "-worker" in threading.current_thread().name:
    from hybridflow.pipeline.host.dispatch import Dispatcher

    async def _broken(self, run, **kwargs):  # type: ignore[no-untyped-def]
        run().close()  # the coroutine it was handed is never awaited: close it quietly
        raise RuntimeError("the dispatcher is broken (tests/pipeline/broken_work_loop.py)")

    Dispatcher.submit = _broken  # type: ignore[method-assign]


def reward(prompts, responses, prompt_ids, response_ids, metadata):
    return [0.0] * len(responses)

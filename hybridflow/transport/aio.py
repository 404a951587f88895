"""The event loop every hybridflow process runs: uvloop where installed, else asyncio's.

`run(main())` is what process entry points call; nothing else in the code base picks a
loop. uvloop trims the per-wakeup cost that dominates small-message round trips.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """`asyncio.run` on the fastest available loop."""
    with asyncio.Runner(debug=debug, loop_factory=loop_factory()) as runner:
        return runner.run(main)

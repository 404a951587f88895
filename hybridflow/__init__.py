"""hybridflow: RL post-training for LLMs as an async, event-driven pipeline on message queues.

Public API: `DataflowBuilder`, `Engine` (the programming model), `__version__`.
Heavy modules (torch, transformers) are imported lazily so `hybridflow --help` is fast.
"""

from __future__ import annotations

from hybridflow.version import __version__

__all__ = ["DataflowBuilder", "Engine", "__version__"]


def __getattr__(name: str):  # PEP 562: lazy public API
    if name in ("DataflowBuilder", "Engine"):
        from hybridflow.pipeline.api import builder

        return getattr(builder, name)
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")

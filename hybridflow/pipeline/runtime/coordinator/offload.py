"""What the coordinator runs off its event loop: the data source, driver ops and sinks.

The event loop never computes. Two named daemon threads (workers.py: Ctrl-C or SIGTERM
must end the process within seconds even while a call is busy in one) take the calls:

    io        DataSource.batch (tokenizing, reading files), metrics and sample sinks'
              writes, checkpoint begin/commit and the driver ops' state
    compute   driver ops (advantages, KL): one at a time, in dispatch order

Each call runs in its thread in submission order (so sinks write steps in order and
driver ops never overlap). While a data batch or a driver op runs, `fetching` and
`driver_started` say since when: the waiting report and the driver ops' deadlines
(pipeline/runtime/watch/watchdog.py) read them. A call that raises comes back as the
named error (failures.py), except the coordinator's own stop, which is re-raised.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from hybridflow.errors import HybridflowError
from hybridflow.pipeline.runtime.coordinator import failures
from hybridflow.pipeline.runtime.steps import Batch, Dispatch
from hybridflow.pipeline.runtime.workers import DaemonExecutor
from hybridflow.pipeline.sources.registry import DataSource


class Offload:
    def __init__(self, source: DataSource, source_name: str, drivers: dict[int, Any]) -> None:
        self.source = source
        self.source_name = source_name  # data.source, for the error
        self.drivers = drivers  # op index -> driver op
        self.compute = DaemonExecutor("coordinator-compute")
        self.io = DaemonExecutor("coordinator-io")
        self.driver_started: dict[int, tuple[float, Dispatch]] = {}  # monotonic start
        self.fetching: dict[int, float] = {}  # step -> monotonic start of its data batch

    async def batch(self, step: int, size: int) -> Batch:
        """Step `step`'s data batch of `size` rows, from the io thread."""
        loop = asyncio.get_running_loop()
        self.fetching[step] = time.monotonic()
        try:
            return await loop.run_in_executor(self.io, self.source.batch, step, size)
        except HybridflowError:
            raise
        except BaseException as exc:  # its own KeyboardInterrupt, SystemExit too
            if failures.stopping(exc):
                raise
            raise failures.source_failed(self.source_name, step, exc) from exc
        finally:
            self.fetching.pop(step, None)

    async def drive(self, d: Dispatch) -> tuple[Batch, dict[str, float]]:
        """Driver op `d` on its inputs, in the compute thread -> (outputs, metrics)."""
        loop = asyncio.get_running_loop()
        params = dict(d.op.cfg.params, step=d.step, mb_id=d.mb_id, policy_version=d.policy_version)
        fn = self.drivers[d.op.index]

        def call() -> Any:  # in the compute thread: the deadline starts when the op does
            self.driver_started[d.task_id] = (time.monotonic(), d)
            try:
                return fn(d.inputs, params)
            finally:
                self.driver_started.pop(d.task_id, None)

        try:
            outputs, metrics = await loop.run_in_executor(self.compute, call)
        except HybridflowError:
            raise
        except BaseException as exc:  # its own KeyboardInterrupt, SystemExit too
            if failures.stopping(exc):
                raise
            raise failures.driver_failed(d, exc) from exc
        return outputs, metrics

    def io_call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """`fn(*args)` in the io thread (a sink's write, a checkpoint's commit)."""
        return asyncio.get_running_loop().run_in_executor(self.io, fn, *args)

    def shutdown(self) -> None:
        """Nothing new starts; what has not started is cancelled; a busy call is left to
        its daemon thread."""
        self.compute.shutdown(wait=False, cancel_futures=True)
        self.io.shutdown(wait=False, cancel_futures=True)

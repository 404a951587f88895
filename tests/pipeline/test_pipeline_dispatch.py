"""The stage host's dispatch rules (pipeline/host/dispatch.py) on fake tasks: which task may
start while which is still running. Every fake task runs until the test releases it, so
orderings are forced, not timed."""

from __future__ import annotations

import asyncio

from hybridflow.pipeline.host.dispatch import Dispatcher, Mode


class Fakes:
    """Fake tasks that log their start and end and run until released."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    def task(self, name: str, fail: bool = False):
        gate = self.gates[name] = asyncio.Event()

        async def run() -> None:
            self.log.append(f"start {name}")
            await gate.wait()
            self.log.append(f"end {name}")
            if fail:
                raise RuntimeError(name)

        return run

    def release(self, name: str) -> None:
        self.gates[name].set()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_concurrent_tasks_run_side_by_side_and_plain_ones_of_other_roles_too():
    d, f = Dispatcher(), Fakes()
    await d.submit(f.task("gen0"), mode=Mode.CONCURRENT, role="rollout")
    await d.submit(f.task("gen1"), mode=Mode.CONCURRENT, role="rollout")
    await d.submit(f.task("ref0"), mode=Mode.PLAIN, role="reference")
    await _settle()
    assert f.log == ["start gen0", "start gen1", "start ref0"]
    for name in ("gen1", "ref0", "gen0"):
        f.release(name)
    await _settle()
    assert len(d) == 0
    await d.close()


async def test_a_plain_task_waits_for_its_own_roles_concurrent_tasks():
    d, f = Dispatcher(), Fakes()
    await d.submit(f.task("gen0"), mode=Mode.CONCURRENT, role="rollout")
    submitting = asyncio.ensure_future(d.submit(f.task("load"), mode=Mode.PLAIN, role="rollout"))
    await _settle()
    assert f.log == ["start gen0"] and not submitting.done()
    f.release("gen0")
    await submitting
    await _settle()
    assert f.log == ["start gen0", "end gen0", "start load"]
    f.release("load")
    await d.close()


async def test_a_barrier_waits_for_everything_and_holds_what_comes_after():
    d, f = Dispatcher(), Fakes()
    await d.submit(f.task("gen0"), mode=Mode.CONCURRENT, role="rollout")
    await d.submit(f.task("upd0", fail=True), mode=Mode.PLAIN, role="actor")

    async def arrivals() -> None:  # what the stage's work loop does, in arrival order
        await d.submit(f.task("step"), mode=Mode.BARRIER)
        await d.submit(f.task("gen1"), mode=Mode.CONCURRENT, role="rollout")

    loop = asyncio.ensure_future(arrivals())
    await _settle()
    assert f.log == ["start gen0", "start upd0"]
    f.release("upd0")  # a failed task does not block the barrier
    await _settle()
    assert "start step" not in f.log
    f.release("gen0")
    await _settle()
    assert f.log[-1] == "start step" and "start gen1" not in f.log
    f.release("step")
    await loop
    await _settle()
    assert f.log[-2:] == ["end step", "start gen1"]
    await d.close()  # cancels gen1, still running
    assert len(d) == 0

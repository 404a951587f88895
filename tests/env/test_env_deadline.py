"""The shared daemon-thread deadline (stages/deadline.py) and its cap on abandoned calls,
as the environment protocol, tools and the per-sample reward caller use it; and
`env_call`, the one place an environment's own exception becomes an EnvError."""

from __future__ import annotations

import threading

import pytest

from hybridflow.errors import EnvError, EnvStuckError, EnvTimeout, RewardFunctionError
from hybridflow.stages.deadline import DaemonCalls, TooManyStuck
from hybridflow.stages.env import protocol
from hybridflow.stages.env.protocol import call, close_env, env_call, stuck_calls
from hybridflow.stages.env.tools import Tool
from hybridflow.stages.reward.per_sample import PerSampleCaller


def test_daemon_calls_count_abandoned_threads_until_they_return():
    release = threading.Event()
    calls = DaemonCalls(max_stuck=2, what="Hang.step", setting="env_timeout_s")
    futs = [calls.start(release.wait, 10, name=f"hang-{i}") for i in range(2)]
    for f in futs:
        calls.abandon(f)
    assert calls.stuck == 2
    with pytest.raises(TooManyStuck, match=r"Hang.step: 2 calls .*max_stuck 2.*env_timeout_s"):
        calls.start(lambda: 1, name="one-more")
    release.set()
    for f in futs:
        assert f.result(timeout=5) is True
    assert calls.stuck == 0
    assert calls.start(lambda: 7, name="after").result(timeout=5) == 7


def test_workers_are_reused_and_never_queue_a_call_behind_a_busy_one():
    """Calls one after another run on one reused thread (named as the call while it
    runs); calls started together run together, even while another call is stuck."""
    calls = DaemonCalls(max_stuck=4, what="Pool.step", setting="env_timeout_s")
    calls.start(lambda: None, name="warm").result(timeout=5)
    before = set(threading.enumerate())
    for i in range(20):
        me = calls.start(
            lambda: (threading.current_thread(), threading.current_thread().name), name=f"call-{i}"
        )
        thread, name = me.result(timeout=5)
        assert name == f"call-{i}" and thread in before  # an idle worker, not a new thread
    release = threading.Event()
    stuck = calls.start(release.wait, 30, name="stuck")
    calls.abandon(stuck)
    together = threading.Barrier(8, timeout=10)  # breaks unless all 8 run at once
    futs = [calls.start(together.wait, name=f"b-{i}") for i in range(8)]
    assert sorted(f.result(timeout=15) for f in futs) == list(range(8))
    release.set()
    assert stuck.result(timeout=5) is True


async def test_an_env_method_that_keeps_hanging_is_capped_by_max_stuck():
    release = threading.Event()

    def hang(_):
        release.wait(10)

    what = "CapTest.step"
    try:
        for _ in range(2):
            with pytest.raises(EnvTimeout):
                await call(hang, None, timeout_s=0.05, what=what, max_stuck=2)
        assert stuck_calls(what) == 2
        with pytest.raises(EnvStuckError, match=r"CapTest.step: 2 calls timed out .*max_stuck 2"):
            await call(hang, None, timeout_s=0.05, what=what, max_stuck=2)
        assert stuck_calls(what) == 2  # the refused call started no thread
    finally:
        release.set()


async def test_a_stuck_tool_stops_the_run_instead_of_becoming_an_observation(monkeypatch):
    monkeypatch.setattr(protocol, "DEFAULT_MAX_STUCK", 1)
    release = threading.Event()

    def slowtool(x: str) -> str:
        """Wait.

        Args:
            x: anything
        """
        release.wait(10)
        return x

    tool = Tool.from_function(slowtool)
    try:
        first = await tool.invoke({"x": "a"}, timeout_s=0.05)
        assert first.error is not None and "timed out" in first.content
        with pytest.raises(EnvStuckError, match=r"tool slowtool: 1 calls timed out"):
            await tool.invoke({"x": "b"}, timeout_s=0.05)
    finally:
        release.set()


def test_per_sample_rewards_share_the_cap():
    release = threading.Event()

    def verifier(data_source, solution_str, ground_truth, extra_info=None):
        release.wait(10)
        return 1.0

    caller = PerSampleCaller(verifier, "hangs", timeout_s=0.05, max_workers=1, max_stuck=1)
    calls = [{"data_source": "", "solution_str": "x", "ground_truth": "1"}] * 2
    try:
        with pytest.raises(
            RewardFunctionError, match=r"reward function hangs: 1 calls .*timeout_s"
        ):
            caller.run(calls)
    finally:
        release.set()


async def test_env_call_names_the_environments_own_failure():
    def broken(_):
        raise KeyError("secret")

    with pytest.raises(EnvError, match=r"Broken.step raised KeyError: 'secret'") as exc:
        await env_call(broken, {}, what="Broken.step")
    assert isinstance(exc.value.__cause__, KeyError) and exc.value.what == "Broken.step"

    class Closes:
        def close(self):
            raise RuntimeError("disk")

    with pytest.raises(EnvError, match=r"Closes.close raised RuntimeError: disk"):
        await close_env(Closes())

"""The environment protocol's types, the sync/async adapter `call`, and the factory
convention (`env: pkg.mod:Class` + `env_options`)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from hybridflow.errors import ConfigError
from hybridflow.stages.env.protocol import (
    Action,
    EnvError,
    EnvTimeout,
    Observation,
    ObservationKind,
    StepResult,
    call,
    close_env,
    is_environment,
)
from hybridflow.stages.env.registry import EnvConfig, make_env_factory

# --- types -------------------------------------------------------------------------


def test_observation_kinds():
    assert Observation.empty().kind is ObservationKind.EMPTY
    msg = Observation.from_messages([{"role": "tool", "name": "calc", "content": "12"}])
    assert msg.kind is ObservationKind.MESSAGES
    assert msg.messages[0]["name"] == "calc"
    assert Observation.from_tokens([5, 6]).kind is ObservationKind.TOKENS


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"messages": ({"role": "tool", "content": "x"},), "token_ids": (1,)}, "not both"),
        ({"messages": ({"content": "x"},)}, "non-empty string 'role'"),
        ({"messages": ({"role": "user", "content": 3},)}, "string 'content'"),
        ({"messages": ("hello",)}, "expected a dict"),
        ({"token_ids": (1, -2)}, "ints >= 0"),
        ({"token_ids": (1, True)}, "ints >= 0"),
    ],
)
def test_malformed_observations_are_refused(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        Observation(**kwargs)


def test_step_result_checks():
    r = StepResult(reward=1, done=True, info={"won": 1, "pred": "9"})
    assert isinstance(r.reward, float) and r.reward == 1.0
    with pytest.raises(ValueError, match="finite"):
        StepResult(reward=float("nan"))
    with pytest.raises(ValueError, match="float32"):
        StepResult(reward=1e39)
    with pytest.raises(ValueError, match="expected a number"):
        StepResult(reward={"score": 1.0})
    with pytest.raises(ValueError, match="carries no observation"):
        StepResult(Observation.from_tokens([1]), done=True)
    with pytest.raises(ValueError, match="number or a string"):
        StepResult(info={"calls": [1, 2]})
    with pytest.raises(ValueError, match="must be an Observation"):
        StepResult(observation=[{"role": "tool", "content": "x"}])  # type: ignore[arg-type]


# --- the adapter ------------------------------------------------------------------


class SyncEnv:
    def __init__(self):
        self.threads: list[str] = []
        self.closed = 0

    def reset(self, record):
        self.threads.append(threading.current_thread().name)
        return Observation.empty()

    def step(self, action):
        self.threads.append(threading.current_thread().name)
        return StepResult(reward=float(len(action.text)), done=True)

    def close(self):
        self.closed += 1


class AsyncEnv:
    def __init__(self, delay=0.0):
        self.delay = delay
        self.closed = 0

    async def reset(self, record):
        return Observation.from_messages([{"role": "user", "content": record["q"]}])

    async def step(self, action):
        await asyncio.sleep(self.delay)
        return StepResult(reward=2.0, done=True)

    async def close(self):
        self.closed += 1


async def test_call_runs_sync_methods_off_the_loop_thread():
    env = SyncEnv()
    assert is_environment(env)
    assert (await call(env.reset, {})).kind is ObservationKind.EMPTY
    result = await call(env.step, Action("abc", (1, 2, 3)))
    assert result.reward == 3.0 and result.done
    main = threading.current_thread().name
    assert len(env.threads) == 2 and main not in env.threads
    assert all(t.startswith("hybridflow-env:SyncEnv.") for t in env.threads)
    await close_env(env)
    assert env.closed == 1


async def test_call_awaits_async_methods():
    env = AsyncEnv()
    obs = await call(env.reset, {"q": "2+2?"})
    assert obs.messages == ({"role": "user", "content": "2+2?"},)
    assert (await call(env.step, Action("x"))).reward == 2.0
    await close_env(env)
    assert env.closed == 1
    await close_env(object())  # no close(): nothing to do


async def test_call_propagates_the_methods_own_exception():
    def broken(_):
        raise KeyError("secret")

    with pytest.raises(KeyError, match="secret"):
        await call(broken, {})


async def test_a_slow_async_env_times_out_by_name():
    env = AsyncEnv(delay=5.0)
    t0 = time.perf_counter()
    with pytest.raises(
        EnvTimeout,
        match=r"AsyncEnv.step did not return within 0.05 s \(bounded by env.step_timeout_s\)",
    ):
        await call(env.step, Action("x"), timeout_s=0.05, setting="env.step_timeout_s")
    assert time.perf_counter() - t0 < 2.0


async def test_a_stuck_sync_env_is_abandoned_at_its_deadline():
    release = threading.Event()

    def stuck(_):
        release.wait(10)
        return 1

    t0 = time.perf_counter()
    with pytest.raises(EnvTimeout) as exc:
        await call(stuck, None, timeout_s=0.05, what="Stuck.step")
    assert time.perf_counter() - t0 < 2.0
    assert exc.value.what == "Stuck.step"
    assert isinstance(exc.value, EnvError) and isinstance(exc.value, TimeoutError)
    release.set()


async def test_many_sync_calls_run_concurrently():
    def slow(x):
        time.sleep(0.2)
        return x

    t0 = time.perf_counter()
    out = await asyncio.gather(*(call(slow, i) for i in range(8)))
    assert out == list(range(8))
    assert time.perf_counter() - t0 < 1.2  # 8 x 0.2 s one after another would be 1.6 s


# --- factory convention -----------------------------------------------------------


class Configurable:
    def __init__(self, *, max_turns: int = 3, bonus: float = 0.0):
        self.max_turns, self.bonus = max_turns, bonus

    def reset(self, record):
        return Observation.empty()

    def step(self, action):
        return StepResult(done=True)


class NotAnEnv:
    def __init__(self):
        pass


def not_an_env_factory():
    return 42


HERE = __name__


def test_factory_builds_a_fresh_instance_per_trajectory():
    factory = make_env_factory(
        f"{HERE}:Configurable", {"max_turns": 5}, path="stages.rollout.options"
    )
    a, b = factory(), factory()
    assert a is not b
    assert (a.max_turns, b.max_turns, a.bonus) == (5, 5, 0.0)


def test_factory_names_a_bad_option_with_its_dotted_path():
    with pytest.raises(ConfigError, match="did you mean 'max_turns'") as exc:
        make_env_factory(f"{HERE}:Configurable", {"max_turn": 5}, path="stages.rollout.options")
    assert exc.value.path == "stages.rollout.options.env_options.max_turn"


def test_factory_refuses_what_is_not_an_environment():
    with pytest.raises(ConfigError, match="no reset/step"):
        make_env_factory(f"{HERE}:NotAnEnv", path="r")
    factory = make_env_factory(f"{HERE}:not_an_env_factory", path="r")
    with pytest.raises(EnvError, match="returned a int"):
        factory()
    with pytest.raises(ConfigError, match="has no attribute"):
        make_env_factory(f"{HERE}:Missing", path="r")


def test_builtin_names_and_config_validation():
    env = make_env_factory("guess_number", {"max_turns": 3})()
    assert type(env).__name__ == "GuessNumberEnv" and env.max_turns == 3
    with pytest.raises(ConfigError, match="did you mean 'calculator'") as exc:
        EnvConfig(env="calculater").validate("stages.rollout.options")
    assert exc.value.path == "stages.rollout.options.env"
    with pytest.raises(ConfigError, match="no `env`"):
        EnvConfig(env_options={"max_turns": 2}).validate("x")
    with pytest.raises(ConfigError, match=r"package\.module:Class"):
        EnvConfig(env="pkg.mod:").validate("x")
    EnvConfig(env="calculator", env_options={"max_turns": 2}).validate("x")
    EnvConfig(env="not.imported.at.plan.time:Env").validate("x")  # syntax only

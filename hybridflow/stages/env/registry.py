"""Naming an environment in config: `env` + `env_options` -> a per-trajectory factory.

    env: pkg.mod:Class            # or a built-in name: calculator, guess_number, python,
                                  # remote (an environment service: service/client.py)
    env_options: {max_turns: 4}   # keyword arguments of Class

    factory = make_env_factory(cfg.env, cfg.env_options, path="stages.rollout.options")
    env = factory()               # Class(**env_options): one fresh object per trajectory

The convention (TRL's `environment_factory`, SkyRL-Gym's registered envs): the named object
is a class, or any callable, that takes `env_options` as keyword arguments and returns an
environment (hybridflow.stages.env.protocol: `reset`, `step`, optional `close`). It is
called once per trajectory, so the instance is that trajectory's state and nothing is
shared between trajectories unless the class shares it on purpose.

`EnvConfig.validate(path)` checks the syntax and the built-in names without importing
anything (safe at plan time); `make_env_factory` imports the target, checks that
`env_options` fit its signature (a wrong key is a ConfigError at
`<path>.env_options.<key>`), and, for a class, that it has `reset` and `step`; a class
with a `check_options(options, path)` static method validates its option values there,
once (RemoteEnv does). Every object the factory builds is checked too (EnvError when it
is no environment).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridflow.config.imports import load_attr, split_spec
from hybridflow.errors import ConfigError
from hybridflow.stages.env.protocol import EnvError, Environment, is_environment

__all__ = ["BUILTIN_ENVS", "EnvConfig", "env_target", "make_env_factory"]

_BUILTIN = "hybridflow.stages.env.builtin"
BUILTIN_ENVS: dict[str, str] = {
    "calculator": f"{_BUILTIN}.calculator:CalculatorEnv",
    "fixed_turns": f"{_BUILTIN}.fixed_turns:FixedTurnsEnv",
    "guess_number": f"{_BUILTIN}.guess_number:GuessNumberEnv",
    "python": f"{_BUILTIN}.python_exec:PythonEnv",
    "remote": "hybridflow.stages.env.service.client:RemoteEnv",
}
_FORM = "package.module:Class"


@dataclass
class EnvConfig:
    env: str = ""  # "package.module:Class" or a built-in name; "" = single-turn
    env_options: dict[str, Any] = field(default_factory=dict)

    def validate(self, path: str) -> None:
        if self.env:
            env_target(self.env, f"{path}.env")
        elif self.env_options:
            raise ConfigError(f"{path}.env_options", "is set but no `env` names an environment")
        if not isinstance(self.env_options, dict) or not all(
            isinstance(k, str) for k in self.env_options
        ):
            raise ConfigError(f"{path}.env_options", "must be a mapping of option names to values")


def env_target(name: str, path: str) -> str:
    """A built-in name or a `package.module:Class` -> the latter (syntax checked only)."""
    if isinstance(name, str) and ":" not in name:
        target = BUILTIN_ENVS.get(name)
        if target is None:
            close = difflib.get_close_matches(name, list(BUILTIN_ENVS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                path,
                f"unknown environment {name!r}: give '{_FORM}' or a built-in "
                f"({', '.join(BUILTIN_ENVS)}){hint}",
            )
        return target
    split_spec(name, path, form=_FORM)
    return name


def make_env_factory(
    env: str, env_options: Mapping[str, Any] | None = None, path: str = ""
) -> Callable[[], Environment]:
    """The per-trajectory factory `() -> Class(**env_options)`; `path` is the config
    section that holds `env` and `env_options` (errors name `<path>.env...`)."""
    key = f"{path}.env" if path else "env"
    target = env_target(env, key)
    cls = load_attr(target, key, callable_only=True, form=_FORM)
    options = dict(env_options or {})
    if inspect.isclass(cls) and not is_environment(cls):
        raise ConfigError(key, f"{target} has no reset/step methods: it is not an environment")
    _check_options(cls, options, f"{key}_options")
    check = getattr(cls, "check_options", None)
    if inspect.isclass(cls) and callable(check):
        check(dict(options), f"{key}_options")

    def factory() -> Environment:
        obj = cls(**options)
        if not is_environment(obj):
            raise EnvError(
                f"{target}(**env_options) returned a {type(obj).__name__}, which has no "
                "reset/step: not an environment",
                what=target,
            )
        return obj  # type: ignore[no-any-return]

    factory.__name__ = f"make_{getattr(cls, '__name__', 'env')}"
    factory.__qualname__ = factory.__name__
    return factory


def _check_options(cls: Callable[..., Any], options: dict[str, Any], path: str) -> None:
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):  # no introspectable signature: the call will tell
        return
    try:
        sig.bind(**options)
    except TypeError as exc:
        params = sig.parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        known = [n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        for name in options:
            if name not in params and not takes_any:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"{path}.{name}", f"unknown option; {cls.__name__} takes {known}{hint}"
                ) from None
        raise ConfigError(path, f"do not fit {getattr(cls, '__name__', cls)}: {exc}") from None

"""Environments and tools for multi-turn (agentic) rollouts: the pure pieces the rollout
stage's trajectory loop drives. Nothing here talks to an engine; only service/ talks to
sockets (and only it imports aiohttp/zmq, when used).

    protocol.py      Observation / Action / StepResult, the Environment protocol (reset/step,
                     sync or async) and `call` / `env_call`, the one bounded way to invoke
                     either (env_call: every failure an EnvError)
    registry.py      `env: pkg.mod:Class` + `env_options` -> a per-trajectory factory
    parsers.py       tool-call parsers (hermes), a registry for other formats
    tools.py         Python functions as tools: OpenAI schemas, one never-raising call
    tool_env.py      ToolEnv: tool calls until a turn without one, then a verl reward
    observations.py  an observation -> the token ids appended after a model turn
    layout.py        turns -> response_ids / response_mask / rollout_logprobs
    builtin/         calculator (word problems + gsm8k), guess_number (end-only reward),
                     python_exec (a python(code) tool in a separate, limited process)
    service/         external environment services: `env: remote` (RemoteEnv) and
                     `hybridflow env-serve pkg.mod:Class` (docs/env-service.md)

One trajectory, as the loop runs it (token-in/token-out: ids are only ever appended):

    env = factory()                                   # registry.make_env_factory
    first = await call(env.reset, record)             # EMPTY: keep the dataset's prompt
    enc = ObservationEncoder(tokenizer, tools=getattr(env, "tools_schema", list)(),
                             stop_token_ids=[<the id ending a turn, e.g. <|im_end|>>])
    traj = Trajectory(prompt_ids)
    while True:
        ids, logprobs, stopped = <engine: continue traj.context_ids()>
        traj.add_turn(ids, logprobs)
        res = await call(env.step, Action(decode(ids), tuple(ids), truncated=not stopped),
                         timeout_s=step_timeout_s)
        if res.done or <max_turns / max_total_tokens>: break
        traj.add_observation(enc.encode(res.observation, closed=stopped))
    layout = traj.layout()                            # what training sees
    await close_env(env)
"""

from __future__ import annotations

from hybridflow.stages.env.layout import ResponseLayout, Trajectory, assemble, collate
from hybridflow.stages.env.observations import ObservationEncoder
from hybridflow.stages.env.parsers import (
    ParsedTurn,
    ParseError,
    ToolCall,
    get_parser,
    register_parser,
)
from hybridflow.stages.env.protocol import (
    Action,
    EnvError,
    Environment,
    EnvStuckError,
    EnvTimeout,
    Observation,
    ObservationKind,
    StepResult,
    call,
    close_env,
    env_call,
    is_environment,
)
from hybridflow.stages.env.registry import EnvConfig, make_env_factory
from hybridflow.stages.env.tool_env import ToolEnv
from hybridflow.stages.env.tools import ErrorKind, Tool, ToolOutcome

__all__ = [
    "Action",
    "EnvConfig",
    "EnvError",
    "EnvStuckError",
    "EnvTimeout",
    "Environment",
    "ErrorKind",
    "Observation",
    "ObservationEncoder",
    "ObservationKind",
    "ParseError",
    "ParsedTurn",
    "ResponseLayout",
    "StepResult",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolOutcome",
    "Trajectory",
    "assemble",
    "call",
    "close_env",
    "collate",
    "env_call",
    "get_parser",
    "is_environment",
    "make_env_factory",
    "register_parser",
]

"""Environments and a misbehaving service core for the environment-service tests
(tests/env/test_env_service*.py). Importable by a served subprocess as
`env_service_helpers:CountingEnv` (the tests run `hybridflow env-serve` with cwd=tests/env)."""

from __future__ import annotations

import asyncio
from typing import Any

from hybridflow.reward.schema import Encoding, RequestRejected
from hybridflow.reward.server import RunningServer, start_front
from hybridflow.stages.env.protocol import Action, Observation, StepResult
from hybridflow.stages.env.service.app import EnvApp
from hybridflow.stages.env.service.schema import (
    HTTP_PATH,
    ZMQ_ENV,
    StepReply,
    StepRequest,
    decode_as,
    decode_request,
    encode,
)


class CountingEnv:
    """Ends on turn `record.turns` (default 2) with reward = turns; observes "ok <k>"
    before that. `delay_s`: each step sleeps (async) that long first; `fail_at`: that
    turn's step raises."""

    def __init__(self, *, delay_s: float = 0.0, fail_at: int = -1) -> None:
        self.delay_s, self.fail_at = delay_s, fail_at
        self.turns, self.limit = 0, 2

    def reset(self, record: dict[str, Any]) -> Observation:
        self.limit = int(record.get("turns", 2))
        return Observation.empty()

    async def step(self, action: Action) -> StepResult:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self.turns += 1
        if self.turns == self.fail_at:
            raise RuntimeError(f"scripted failure at turn {self.turns}")
        if self.turns >= self.limit:
            return StepResult(Observation.empty(), float(self.turns), True, {"echo": action.text})
        obs = Observation.from_messages([{"role": "user", "content": f"ok {self.turns}"}])
        return StepResult(obs, 0.0, False, {"tool_calls": 1})


class Faulty:
    """A ServiceCore around an EnvApp that misbehaves on chosen calls. `plan` maps a call
    ("reset", "step 0", "close", ...) to the faults of its successive requests:
      "503"        answer 503 before the call reaches the app
      "lose"       the app answers, the reply is held back past any client timeout
      "garbage"    200 with bytes that are no reply
      "wrong-step" 200 with the app's reply for another step_id
      "ok"         as the app answers
    `seen` counts the requests per call."""

    def __init__(self, app: EnvApp, plan: dict[str, list[str]] | None = None) -> None:
        self.app, self.plan = app, {k: list(v) for k, v in (plan or {}).items()}
        self.name, self.max_body_bytes = app.name, app.max_body_bytes
        self.seen: dict[str, int] = {}
        self.held = asyncio.Event()  # set at teardown: lost replies stop waiting

    def health(self, encoding: Encoding) -> bytes:
        return self.app.health(encoding)

    async def handle(self, body: bytes, encoding: Encoding) -> bytes:
        req = decode_request(body, encoding, max_body_bytes=self.max_body_bytes)
        key = f"step {req.step_id}" if isinstance(req, StepRequest) else type(req).__name__[:-7]
        key = key.lower()
        self.seen[key] = self.seen.get(key, 0) + 1
        faults = self.plan.get(key)
        fault = faults.pop(0) if faults else "ok"
        if fault == "503":
            raise RequestRejected(503, "scripted overload")
        reply = await self.app.handle(body, encoding)
        if fault == "lose":
            await self.held.wait()
            raise RequestRejected(500, "a lost reply, released at teardown")
        if fault == "garbage":
            return b"\x00\x01 this is no reply"
        if fault == "wrong-step":
            r = decode_as(reply, StepReply, encoding)
            return encode(
                StepReply(
                    version=r.version, session_id=r.session_id, step_id=r.step_id + 7, done=r.done
                ),
                encoding,
            )
        return reply

    async def aclose(self) -> None:
        self.held.set()
        await self.app.aclose()


async def serve_faulty(
    protocol: str, plan: dict[str, list[str]] | None = None, **app_options: Any
) -> tuple[RunningServer, Faulty]:
    """CountingEnv served by a Faulty core on a free loopback port (grace 0.2 s)."""
    env_options = app_options.pop("env_options", {})
    app = EnvApp(lambda: CountingEnv(**env_options), "CountingEnv", **app_options)
    core = Faulty(app, plan)
    server = await start_front(
        core,
        protocol,  # type: ignore[arg-type]
        "127.0.0.1",
        0,
        grace_s=0.2,
        http_paths=("/", HTTP_PATH),
        http_path=HTTP_PATH,
        zmq_method=ZMQ_ENV,
    )
    return server, core

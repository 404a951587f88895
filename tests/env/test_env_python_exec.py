"""The python(code) tool: a separate process under CPU, memory, wall-time and output
limits (stages/env/builtin/python_exec.py); what the model reads in each case."""

from __future__ import annotations

import json
import os

import pytest

from hybridflow.errors import ConfigError
from hybridflow.stages.env.builtin.python_exec import (
    ExecLimits,
    PythonEnv,
    make_python_tool,
    python,
    run_python,
)
from hybridflow.stages.env.protocol import Action, call
from hybridflow.stages.env.registry import make_env_factory


def test_normal_output_runs_in_its_own_process_and_directory():
    r = run_python("import os, sys\nprint(6 * 7)\nprint(os.getcwd(), sys.flags.isolated)")
    assert r.ok and r.killed == "" and r.exit_code == 0
    answer, rest = r.stdout.split("\n", 1)
    cwd, isolated = rest.split()
    assert answer == "42" and isolated == "1"
    assert cwd != os.getcwd() and not os.path.exists(cwd)  # a fresh directory, removed after
    assert python("print('hi')") == "hi\n"
    assert python("x = 1") == "(no output)"


def test_an_infinite_loop_is_killed_by_the_cpu_limit():
    r = run_python("while True:\n    pass", ExecLimits(cpu_s=1, wall_s=60))
    assert r.killed == "cpu" and r.exit_code is None and r.cpu_s >= 0.95
    assert r.text() == "killed: CPU time limit of 1 s exceeded"


def test_a_sleeping_program_is_killed_by_the_wall_limit():
    r = run_python(
        "import time\nprint('started', flush=True)\ntime.sleep(60)", ExecLimits(wall_s=3)
    )
    assert r.killed == "wall" and r.stdout == "started\n"
    assert r.text().endswith("killed: wall-time limit of 3 s exceeded")


def test_a_memory_hog_is_stopped_by_the_address_space_limit():
    hog = "blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))"
    r = run_python(hog, ExecLimits(memory_mb=128, wall_s=30))
    assert not r.ok and r.exit_code == 1
    assert "MemoryError" in r.stderr and r.text().endswith("exit code 1")


def test_an_exception_is_shown_as_text():
    text = make_python_tool(ExecLimits(wall_s=20))("print('before')\n1 / 0")
    assert text.startswith("before\nstderr:\nTraceback")
    assert "ZeroDivisionError: division by zero" in text and text.endswith("exit code 1")


def test_output_is_truncated_and_oversize_code_is_not_run():
    r = run_python("print('x' * 5000)", ExecLimits(max_output_chars=100))
    assert r.truncated and r.stdout == "x" * 100 + "...(truncated)" and r.ok
    r = run_python("print(1)\n" * 20, ExecLimits(max_code_chars=50))
    assert r.killed == "code" and "at most 50" in r.text()
    assert run_python("print('\x00')").killed == "code"


def test_network_is_isolated_or_the_run_refused():
    code = "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=3)"
    r = run_python(code, ExecLimits(network="isolate", wall_s=20))
    if r.killed == "refused":  # this host cannot unshare a network namespace
        assert "network isolation is not available" in r.text()
    else:
        assert r.network_isolated and "Network is unreachable" in r.stderr


def test_limits_are_checked_by_their_dotted_name():
    with pytest.raises(ConfigError, match=r"env_options\.cpu_s: must be an int >= 1"):
        PythonEnv(cpu_s=0)
    with pytest.raises(ConfigError, match=r"env_options\.network"):
        ExecLimits(network="off").validate()  # type: ignore[arg-type]


async def test_python_env_runs_the_tool_from_a_hermes_call():
    env = make_env_factory("python", {"wall_s": 20, "max_turns": 3})()
    assert isinstance(env, PythonEnv)
    assert [s["function"]["name"] for s in env.tools_schema()] == ["python"]
    await call(env.reset, {})
    turn = "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": "print(2**10)"}})
    r = await call(env.step, Action(turn + "</tool_call>"))
    assert r.observation.messages == ({"role": "tool", "name": "python", "content": "1024\n"},)
    assert r.info["tool_errors"] == 0 and not r.done
    r = await call(env.step, Action("The answer is 1024."))
    assert r.done

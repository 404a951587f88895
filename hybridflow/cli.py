"""`hybridflow` command line: run | validate | eval | status | view | bench | reward-serve |
env-serve | demo.

Each subcommand's implementation is imported only when it is used, so `--help` and
`validate` stay fast and never import torch unless they must.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence

from hybridflow import __version__
from hybridflow.errors import HybridflowError

BENCHES = (
    "transport",
    "overlap",
    "reward",
    "reshard",
    "rollout",
    "engine-reuse",
    "step",
    "native-engine",
    "logprob-gap",
    "train",
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridflow", description=__doc__)
    p.add_argument("--version", action="version", version=f"hybridflow {__version__}")
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR")
    sub = p.add_subparsers(dest="cmd", required=True)

    def config_args(sp: argparse.ArgumentParser, required: bool = True) -> None:
        sp.add_argument(
            "config",
            nargs=None if required else "?",
            help="a YAML topology file or the name of a bundled preset",
        )
        sp.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config value by dotted key, e.g. --set run.steps=3 (repeatable)",
        )

    r = sub.add_parser("run", help="run a topology (file or preset) to completion")
    config_args(r)
    r.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="DIR|latest",
        help="continue from a checkpoint: 'latest' (the default) under checkpoint.save_dir, "
        "a checkpoint directory, or a save directory (its latest)",
    )
    r.add_argument(
        "--launcher",
        choices=("local", "ray"),
        default="local",
        help="where stage processes run: this host (default) or a Ray cluster",
    )
    r.add_argument(
        "--address",
        default=None,
        metavar="ADDR",
        help="with --launcher ray: the cluster to join (default: RAY_ADDRESS, else a local one)",
    )

    v = sub.add_parser("validate", help="check a config and print the resolved topology")
    config_args(v)
    v.add_argument("--json", action="store_true", help="print the resolved topology as JSON")
    v.add_argument(
        "--allow-cwd-imports",
        action="store_true",
        help="let modules the config names load from the working directory too "
        "(default: installed packages and PYTHONPATH only)",
    )

    e = sub.add_parser(
        "eval", help="evaluate a policy on the config's validation set and print JSON"
    )
    config_args(e)
    e.add_argument(
        "--checkpoint",
        nargs="?",
        const="latest",
        default=None,
        metavar="DIR|latest",
        help="the policy to evaluate: 'latest' under checkpoint.save_dir, a checkpoint "
        "directory or a save directory (default: the config's initial models)",
    )

    b = sub.add_parser("bench", help="run a benchmark and print one JSON object")
    b.add_argument("what", choices=BENCHES)
    b.add_argument("--json", action="store_true", help="print JSON only (default: JSON too)")
    b.add_argument("--config", default=None, help="topology file or preset (where relevant)")
    b.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    b.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
    b.add_argument("--out", default=None, help="also write the JSON to this file")

    s = sub.add_parser("reward-serve", help="serve a Python reward function over HTTP or ZeroMQ")
    s.add_argument("function", help="package.module:function")
    s.add_argument("--protocol", choices=("http", "zmq"), default="http")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-batch", type=int, default=256, help="most items per request")
    s.add_argument("--concurrency", type=int, default=8, help="requests scored at once")
    s.add_argument(
        "--body-timeout-s",
        type=float,
        default=None,
        help="seconds a client has to send a request body (default 30, or "
        "$HYBRIDFLOW_REWARD_BODY_TIMEOUT_S)",
    )

    es = sub.add_parser("env-serve", help="serve an environment class over HTTP or ZeroMQ")
    es.add_argument("env", help="package.module:Class, or a built-in name (guess_number, ...)")
    es.add_argument("--options", default="{}", help="the class's env_options, a JSON object")
    es.add_argument("--protocol", choices=("http", "zmq"), default="http")
    es.add_argument("--host", default="127.0.0.1")
    es.add_argument("--port", type=int, default=8100)
    es.add_argument(
        "--call-timeout-s", type=float, default=60.0, help="bound of one reset/step/close"
    )
    es.add_argument("--max-sessions", type=int, default=1024, help="sessions open at once")
    es.add_argument(
        "--session-ttl-s", type=float, default=600.0, help="idle seconds before a session closes"
    )
    es.add_argument(
        "--parent-pid",
        type=int,
        default=0,
        help="exit when this process dies (a rollout stage's env_process: true)",
    )

    st = sub.add_parser(
        "status",
        help="what a live run in RUN_DIR waits on (from another shell); exit 1 if not alive",
    )
    st.add_argument("run_dir", metavar="RUN_DIR", help="the run's run_dir (an Engine's log_dir)")

    vw = sub.add_parser(
        "view",
        help="serve a local page of a run (curves, timing, sampled generations), live",
    )
    vw.add_argument("run_dir", metavar="RUN_DIR", help="the run's run_dir, e.g. runs/<name>")
    vw.add_argument("--port", type=int, default=8600, help="port to listen on (0: any free one)")
    vw.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default loopback; any other is warned about: no authentication)",
    )

    d = sub.add_parser("demo", help="the built-in default job (what `make demo` runs)")
    d.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return p


def _call(target: str, args: argparse.Namespace) -> int:
    """Import `module:function` and call it with the parsed args; it returns an exit code."""
    module, func = target.split(":")
    return int(getattr(importlib.import_module(module), func)(args) or 0)


COMMANDS = {
    "run": "hybridflow.pipeline.runtime.runner:cli_run",
    "validate": "hybridflow.pipeline.runtime.runner:cli_validate",
    "eval": "hybridflow.pipeline.runtime.jobs.evaluate:cli_eval",
    "status": "hybridflow.pipeline.runtime.watch.status:cli_status",
    "view": "hybridflow.view.server:cli_view",
    "reward-serve": "hybridflow.reward.server:cli_serve",
    "env-serve": "hybridflow.stages.env.service.server:cli_serve",
    "demo": "hybridflow.demo:cli_demo",
}


def _bench(args: argparse.Namespace) -> int:
    mod = importlib.import_module(f"hybridflow.bench.{args.what.replace('-', '_')}")
    result = mod.run(args)
    text = json.dumps(result, indent=None if args.json else 2, sort_keys=False)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s",
    )
    try:
        if args.cmd == "bench":
            return _bench(args)
        return _call(COMMANDS[args.cmd], args)
    except HybridflowError as exc:
        print(f"hybridflow: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hybridflow: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

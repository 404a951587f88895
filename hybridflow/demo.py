"""`hybridflow demo` / `make demo`: the built-in default job.

Until the RL demo exists this runs the transport benchmark on its quick sizes.
"""

from __future__ import annotations

import argparse
import json


def cli_demo(args: argparse.Namespace) -> int:
    from hybridflow.bench import transport

    ns = argparse.Namespace(json=True, config=None, overrides=args.overrides, quick=True, out=None)
    print(json.dumps(transport.run(ns), indent=2))
    return 0

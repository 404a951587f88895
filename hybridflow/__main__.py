"""`python -m hybridflow`: the same CLI as the `hybridflow` console script, on the same path.

`python -m` puts the working directory first on `sys.path`; the console script does not.
Left there, a `json.py` (or `yaml.py`, `torch.py`, ...) in the directory a user runs from
would be imported into the coordinator in place of the real module. So the entry goes
before anything else is imported (only `os` and `sys`, which the interpreter has already
loaded), unless PYTHONPATH names that directory. `validate --allow-cwd-imports` puts it
back, last, for the modules a config names (config/imports.py `cwd_off_path`).
"""

import os
import sys


def _drop_cwd_entry() -> None:
    if sys.flags.safe_path or not sys.path:  # `python -P`: nothing was put there
        return
    cwd = os.path.realpath(os.getcwd())
    named = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    if os.path.realpath(sys.path[0] or ".") == cwd and cwd not in named:
        del sys.path[0]


_drop_cwd_entry()

from hybridflow.cli import main  # noqa: E402  (after the path is fixed, on purpose)

raise SystemExit(main())

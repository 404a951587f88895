"""mkdocs hook (mkdocs.yml `hooks:`): adds the generated reference pages to every build.

A problem `pages.problems()` finds (an undocumented option) is logged as a warning, so
`mkdocs build --strict` (make docs-check, in make test) fails on it, and a plain
`mkdocs build` (make docs) still builds and shows it.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for `docgen`

from docgen import pages

log = logging.getLogger("mkdocs.plugins.hybridflow.docgen")


def on_files(files: Files, config: Any) -> Files:
    for problem in pages.problems():
        log.warning(problem)
    for path, text in pages.generate().items():
        if files.get_file_from_path(path) is not None:
            log.warning(f"docs/{path} exists, but it is generated: remove the file")
            continue
        files.append(File.generated(config, path, content=text))
    return files

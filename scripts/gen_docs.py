"""Write the generated reference pages of the docs site to a directory, or check them.

    python scripts/gen_docs.py --out /tmp/ref     # the pages mkdocs would generate
    python scripts/gen_docs.py --check            # exit 1 if an option has no doc

`mkdocs build` (make docs) generates the same pages itself (scripts/docgen/mkdocs_hook.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from docgen import pages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the pages under this directory")
    ap.add_argument("--check", action="store_true", help="list undocumented options")
    args = ap.parse_args(argv)
    if args.out:
        for path, text in pages.generate().items():
            target = args.out / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            print(target)
    problems = pages.problems()
    for problem in problems:
        print(f"gen_docs: {problem}", file=sys.stderr)
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    raise SystemExit(main())

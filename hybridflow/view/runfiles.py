"""A run directory as the viewer reads it: the files a run writes, read as they grow.

    RunFiles(run_dir)          raises NotARun unless the directory holds one of RUN_FILES
      .poll()                  reads what was appended since the last poll (every file)
      .metrics / .samples      JsonlTail: the rows so far, a generation number, bad lines
      .json(name)              summary.json / status.json, parsed (None when absent/unreadable)

A run writes metrics.jsonl (one row per step, validation rows carry `val/` keys) and
samples.jsonl (pipeline/observe/samples.py) a line at a time while it goes; status.json
(the coordinator's, while it runs) and summary.json (`hybridflow demo`) whole. A run of
an older version may have metrics.jsonl alone: every file is optional but one.

Reading is incremental: a JsonlTail keeps the byte offset it read to and parses only
whole lines; the bytes after the last newline wait for the next poll (a line the writer
has not finished). A file that shrank, was replaced (another inode) or whose bytes before
the offset changed (a resumed run rewrote it) is read again from the start, and the
tail's `generation` goes up so a client that has rows knows to drop them. A line that is
not a JSON object is counted in `bad` and skipped.

Invariant: stdlib only (the viewer starts without torch); the readers never write.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # pipeline/observe/samples.py writes it
SUMMARY_FILE = "summary.json"
STATUS_FILE = "status.json"  # pipeline/runtime/watch/status.py writes it
RUN_FILES = (METRICS_FILE, SAMPLES_FILE, SUMMARY_FILE)  # a run has at least one
_CHECK = 64  # bytes before the offset re-read each poll: a rewritten file reads anew
_JSON_LIMIT = 1 << 20  # status.json / summary.json larger than this are not a run's


class NotARun(ValueError):
    """The directory holds none of RUN_FILES (or is no directory)."""


class JsonlTail:
    """The JSON-object lines of one file, read as it grows (module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self.generation = 0  # +1 each time the file is read again from the start
        self.bad = 0  # lines that were not a JSON object
        self._offset = 0
        self._partial = b""
        self._file_id: tuple[int, int] | None = None
        self._tail = b""  # the last _CHECK bytes before _offset, as read

    @property
    def exists(self) -> bool:
        return self._file_id is not None

    def poll(self) -> bool:
        """Read what was appended; -> whether anything changed."""
        try:
            st = os.stat(self.path)
        except OSError:
            if self._file_id is None:
                return False
            self._restart()
            self._file_id = None
            return True
        file_id = (st.st_dev, st.st_ino)
        restarted = False
        if self._file_id is not None and (
            file_id != self._file_id or st.st_size < self._offset or not self._same_prefix()
        ):
            self._restart()
            restarted = True
        self._file_id = file_id
        if st.st_size == self._offset:
            return restarted
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(st.st_size - self._offset)
        except OSError:
            return restarted
        self._offset += len(data)
        self._tail = (self._tail + data)[-_CHECK:]
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # b"" after a final newline; else a line being written
        for line in lines:
            self._add(line)
        return True

    def _add(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            row = json.loads(line)
        except ValueError:  # also UnicodeDecodeError
            self.bad += 1
            return
        if isinstance(row, dict):
            self.rows.append(row)
        else:
            self.bad += 1

    def _same_prefix(self) -> bool:
        if not self._tail:
            return True
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset - len(self._tail))
                return f.read(len(self._tail)) == self._tail
        except OSError:
            return False

    def _restart(self) -> None:
        self.rows, self.bad, self._offset, self._partial, self._tail = [], 0, 0, b"", b""
        self.generation += 1


class RunFiles:
    """One run directory's files (module docstring). Thread-safe: the server's request
    threads share one, each call under its lock."""

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        if not self.dir.is_dir():
            what = "does not exist" if not self.dir.exists() else "is not a directory"
            raise NotARun(f"{str(self.dir)!r} {what}")
        if not any((self.dir / name).is_file() for name in RUN_FILES):
            raise NotARun(
                f"{str(self.dir)!r} is not a run directory: it has none of "
                f"{', '.join(RUN_FILES)} (a run writes metrics.jsonl and samples.jsonl with "
                "metrics.backends: [jsonl]; give the run's run_dir, e.g. runs/<name>)"
            )
        self.metrics = JsonlTail(self.dir / METRICS_FILE)
        self.samples = JsonlTail(self.dir / SAMPLES_FILE)
        self.lock = threading.Lock()

    def poll(self) -> None:
        with self.lock:
            self.metrics.poll()
            self.samples.poll()

    def json(self, name: str) -> dict[str, Any] | None:
        path = self.dir / name
        try:
            if path.stat().st_size > _JSON_LIMIT:
                return None
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # absent, or caught mid-write: next poll
            return None
        return value if isinstance(value, dict) else None

    def present(self) -> dict[str, bool]:
        return {
            name: (self.dir / name).is_file()
            for name in (METRICS_FILE, SAMPLES_FILE, SUMMARY_FILE, STATUS_FILE)
        }

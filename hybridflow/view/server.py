"""`hybridflow view RUN_DIR [--port P] [--host H]`: a local page of one run, live.

    browser --GET /----------------> index.html, /static/app.js, /static/style.css
            --GET /api/run---------> name, files present, status.json, summary.json, counts
            --GET /api/metrics?since=K&generation=G
                                   -> metrics.jsonl rows K.. (all of them, `reset`, when
                                      the file was rewritten since generation G)
            --GET /api/samples?split=&step=&source=&min_reward=&max_reward=&q=&limit=&offset=
                                   -> samples.jsonl lines that match, newest step first,
                                      with the steps, sources and splits there are
    (the page polls the three every few seconds: runfiles.py reads what was appended)

The page draws the curves itself (SVG, plain JS); every asset ships in the package
(static/), nothing is fetched from elsewhere, and the Content-Security-Policy says so.

Security: loopback by default. A non-loopback --host is allowed with a warning (the
viewer has no authentication: whoever reaches the port reads the run's prompts and
generations). On loopback, requests whose Host header names another host are refused
(403), so a web page cannot read the run through DNS rebinding. GET and HEAD only; the
only files served are the packaged assets and the run's own files, parsed.

Errors: a RUN_DIR that is not a run, or a port that cannot be bound, is a ConfigError
(the CLI prints one line and exits 2).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import socket
import sys
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from hybridflow.config.schema import is_loopback
from hybridflow.errors import ConfigError
from hybridflow.view.runfiles import STATUS_FILE, SUMMARY_FILE, NotARun, RunFiles

log = logging.getLogger("hybridflow.view")

POLL_MS = 3000  # how often the page asks for news
MAX_LIMIT = 1000  # samples per response at most
ASSETS = {  # path -> (packaged file, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
}
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class BadQuery(ValueError):
    """A query parameter that does not parse; answered with 400 and its name."""


# -- the JSON answers (pure functions of the run's files: the unit tests call them) -----
def run_info(run: RunFiles) -> dict[str, Any]:
    run.poll()
    with run.lock:
        metrics, samples = run.metrics, run.samples
        train = [r for r in metrics.rows if not _is_val(r)]
        steps = [r["step"] for r in train if isinstance(r.get("step"), int | float)]
        return {
            "run_dir": str(run.dir),
            "name": run.dir.resolve().name,
            "files": run.present(),
            "status": run.json(STATUS_FILE),
            "summary": run.json(SUMMARY_FILE),
            "metric_rows": len(metrics.rows),
            "train_steps": len(train),
            "last_step": max(steps) if steps else None,
            "samples": len(samples.rows),
            "bad_lines": {"metrics": metrics.bad, "samples": samples.bad},
            "poll_ms": POLL_MS,
        }


def metrics_since(run: RunFiles, query: dict[str, str]) -> dict[str, Any]:
    since = _int(query, "since", 0, low=0)
    generation = _int(query, "generation", -1, low=-1)
    run.poll()
    with run.lock:
        tail = run.metrics
        reset = generation != tail.generation
        start = 0 if reset else min(since, len(tail.rows))
        return {
            "generation": tail.generation,
            "reset": reset,
            "start": start,
            "next": len(tail.rows),
            "rows": [_finite(r) for r in tail.rows[start:]],
        }


def samples_matching(run: RunFiles, query: dict[str, str]) -> dict[str, Any]:
    split = query.get("split", "")
    source = query.get("source")
    steps = _step_range(query.get("step", ""))
    low = _float(query, "min_reward")
    high = _float(query, "max_reward")
    text = query.get("q", "").lower()
    limit = _int(query, "limit", 100, low=1, high=MAX_LIMIT)
    offset = _int(query, "offset", 0, low=0)
    run.poll()
    with run.lock:
        rows = list(run.samples.rows)
        generation = run.samples.generation
    every_step = sorted({s for r in rows if isinstance(s := r.get("step"), int)}, reverse=True)
    sources = sorted({str(r.get("data_source", "")) for r in rows})
    splits = sorted({str(r.get("split", "train")) for r in rows})

    def keep(r: dict[str, Any]) -> bool:
        if split and str(r.get("split", "train")) != split:
            return False
        if source is not None and str(r.get("data_source", "")) != source:
            return False
        step = r.get("step")
        if steps is not None and not (isinstance(step, int) and steps[0] <= step <= steps[1]):
            return False
        reward = r.get("reward")
        if low is not None or high is not None:
            if not isinstance(reward, int | float):
                return False
            if (low is not None and reward < low) or (high is not None and reward > high):
                return False
        if text:
            hay = f"{r.get('prompt', '')}\n{r.get('response', '')}".lower()
            if text not in hay:
                return False
        return True

    # Newest step first; within a step, the order the run wrote them in.
    order = sorted(range(len(rows)), key=lambda i: (-_step_key(rows[i]), i))
    matched = [rows[i] for i in order if keep(rows[i])]
    return {
        "generation": generation,
        "total": len(rows),
        "matched": len(matched),
        "offset": offset,
        "rows": [_finite(r) for r in matched[offset : offset + limit]],
        "steps": every_step,
        "sources": sources,
        "splits": splits,
    }


def _is_val(row: dict[str, Any]) -> bool:
    keys = [k for k in row if k != "step"]
    return bool(keys) and all(k.startswith("val/") for k in keys)


def _step_key(row: dict[str, Any]) -> float:
    step = row.get("step")
    return float(step) if isinstance(step, int | float) else -math.inf


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf (which Python's json reads) as null: the browser's JSON.parse refuses them."""
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()
    }


def _int(query: dict[str, str], key: str, default: int, low: int, high: int | None = None) -> int:
    raw = query.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadQuery(f"{key}: not an integer: {raw!r}") from None
    if value < low or (high is not None and value > high):
        raise BadQuery(f"{key}: {value} is out of range")
    return value


def _float(query: dict[str, str], key: str) -> float | None:
    raw = query.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise BadQuery(f"{key}: not a number: {raw!r}") from None
    if not math.isfinite(value):
        raise BadQuery(f"{key}: not a finite number: {raw!r}")
    return value


def _step_range(raw: str) -> tuple[int, int] | None:
    """`step=`: "" (every step), "N", or "N-M" (inclusive)."""
    raw = raw.strip()
    if not raw:
        return None
    lo, sep, hi = raw.partition("-")
    try:
        first = int(lo)
        last = int(hi) if sep else first
    except ValueError:
        raise BadQuery(f"step: give N or N-M, not {raw!r}") from None
    return (first, last) if first <= last else (last, first)


# -- HTTP ------------------------------------------------------------------------------
API = {"/api/run": "run", "/api/metrics": "metrics", "/api/samples": "samples"}


class ViewServer(ThreadingHTTPServer):
    daemon_threads = True  # a browser's open connection never holds up Ctrl-C

    def __init__(self, run: RunFiles, host: str, port: int) -> None:
        self.run = run
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.loopback = is_loopback(host)
        super().__init__((host, port), Handler)

    @property
    def url(self) -> str:
        host, port = str(self.server_address[0]), self.server_address[1]
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"

    def host_allowed(self, header: str | None) -> bool:
        """On loopback: the Host header names a loopback host (DNS rebinding refused)."""
        if not self.loopback:
            return True
        if not header:
            return False
        name = header.rsplit(":", 1)[0] if not header.endswith("]") else header
        name = name.strip("[]")
        return name == "localhost" or is_loopback(name)


class Handler(BaseHTTPRequestHandler):
    server: ViewServer
    server_version = "hybridflow-view"
    protocol_version = "HTTP/1.1"

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _answer(self, head: bool) -> None:
        if not self.server.host_allowed(self.headers.get("Host")):
            self._send(HTTPStatus.FORBIDDEN, b"unexpected Host header\n", "text/plain", head)
            return
        url = urlsplit(self.path)
        if url.path in ASSETS:
            name, ctype = ASSETS[url.path]
            body = resources.files("hybridflow.view").joinpath("static", name).read_bytes()
            self._send(HTTPStatus.OK, body, ctype, head)
            return
        kind = API.get(url.path)
        if kind is None:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such page: {url.path}"}, head)
            return
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        try:
            if kind == "run":
                doc = run_info(self.server.run)
            elif kind == "metrics":
                doc = metrics_since(self.server.run, query)
            else:
                doc = samples_matching(self.server.run, query)
        except BadQuery as exc:
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(exc)}, head)
            return
        self._json(HTTPStatus.OK, doc, head)

    def _json(self, status: HTTPStatus, doc: dict[str, Any], head: bool) -> None:
        body = json.dumps(doc, ensure_ascii=False, allow_nan=False, default=str).encode()
        self._send(status, body, "application/json; charset=utf-8", head)

    def _send(self, status: HTTPStatus, body: bytes, ctype: str, head: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", _CSP)
        self.send_header("Referrer-Policy", "no-referrer")
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def make_server(run_dir: str | Path, host: str, port: int) -> ViewServer:
    """The server of `run_dir`, bound (port 0: any free one), not yet serving."""
    try:
        run = RunFiles(run_dir)
    except NotARun as exc:
        raise ConfigError("RUN_DIR", str(exc)) from None
    try:
        return ViewServer(run, host, port)
    except OSError as exc:
        raise ConfigError(
            "--port" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else "--host",
            f"cannot listen on {host}:{port}: {exc.strerror or exc}",
        ) from exc


def cli_view(args: argparse.Namespace) -> int:
    server = make_server(args.run_dir, args.host, args.port)
    if not server.loopback:
        print(
            f"hybridflow view: warning: {args.host} is not a loopback address, and the viewer "
            "has no authentication: anyone who can reach this port can read the run's "
            "metrics, prompts and generations",
            file=sys.stderr,
            flush=True,
        )
    print(f"hybridflow view: {Path(args.run_dir)} on {server.url} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0

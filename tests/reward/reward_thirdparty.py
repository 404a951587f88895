"""Minimal third-party reward services written directly on the standard library
(`http.server`) and raw pyzmq, so tests can make a real service misbehave on purpose.

Each server runs in its own thread on 127.0.0.1 and a free port, and calls
`behave(request: dict, attempt: int) -> (status, body: bytes, delay_s)` per request,
where `attempt` counts how often this request_id was seen. It records every request
and the most requests it ever had in flight at once.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import zmq

Behaviour = Callable[[dict, int], tuple[int, bytes, float]]


def good_reply(req: dict, score: Callable[[dict], float] = lambda item: len(item["response_ids"])):
    return {
        "version": 1,
        "request_id": req["request_id"],
        "rewards": [{"id": it["id"], "reward": score(it)} for it in req["items"]],
    }


def ok(req: dict, attempt: int) -> tuple[int, bytes, float]:
    return 200, json.dumps(good_reply(req)).encode(), 0.0


class _Recorder:
    def __init__(self, behave: Behaviour) -> None:
        self.behave = behave
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        self.attempts: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0

    def enter(self, req: dict) -> int:
        with self.lock:
            self.requests.append(req)
            self.attempts[req.get("request_id", "")] += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return self.attempts[req.get("request_id", "")]

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1


class StdlibHttpService(_Recorder):
    """A JSON-over-HTTP service on http.server; `behave` bodies are sent verbatim."""

    def __init__(self, behave: Behaviour = ok) -> None:
        super().__init__(behave)
        rec = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like a real service

            def do_POST(self):
                data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                req = json.loads(data)
                attempt = rec.enter(req)
                try:
                    status, body, delay = rec.behave(req, attempt)
                    time.sleep(delay)
                finally:
                    rec.leave()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout): fine

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, args=(0.05,), name="stdlib-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5)


class RawZmqService(_Recorder):
    """A MessagePack-over-ROUTER service on raw pyzmq. `behave` returns a JSON body that is
    re-encoded as MessagePack (so NaN survives), or raw bytes prefixed with b"RAW:" to send
    verbatim. Requests are handled one at a time, each after its delay."""

    def __init__(
        self, behave: Behaviour = ok, frames: Callable[[list[bytes]], list[bytes]] | None = None
    ):
        super().__init__(behave)
        self.frames = frames  # optional override of the reply frames (after identity)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raw-zmq", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(20):
                continue
            ident, _method, rid, body = self.sock.recv_multipart()
            req = msgspec.msgpack.decode(body)
            attempt = self.enter(req)
            try:
                status, out, delay = self.behave(req, attempt)
                time.sleep(delay)
            finally:
                self.leave()
            if out.startswith(b"RAW:"):
                payload = out[4:]
            else:
                payload = msgspec.msgpack.encode(json.loads(out))
            reply = [str(status).encode(), rid, payload]
            if self.frames is not None:
                reply = self.frames(reply)
            self.sock.send_multipart([ident, *reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()

"""The run viewer without a browser: the JSON endpoints on run directories written line by
line (a partial last line, a rewritten file, a run of an older version with metrics.jsonl
alone), the samples filters, bad input at the CLI (not a run: exit 2), the HTTP layer
over a real socket (assets, headers, Host check, 400/404), the bind warning, and that the
viewer starts without torch."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hybridflow import cli
from hybridflow.errors import ConfigError
from hybridflow.view import runfiles
from hybridflow.view.runfiles import NotARun, RunFiles
from hybridflow.view.server import (
    ASSETS,
    BadQuery,
    ViewServer,
    cli_view,
    make_server,
    metrics_since,
    run_info,
    samples_matching,
)


def lines(path: Path, *rows: dict, partial: str = "") -> None:
    with path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write(partial)


SAMPLES = [
    {
        "step": 0,
        "split": "val",
        "data_source": "a",
        "prompt": "p0",
        "response": "r0",
        "reward": 0.0,
    },
    {
        "step": 0,
        "split": "train",
        "data_source": "a",
        "prompt": "p1",
        "response": "x",
        "reward": 1.0,
    },
    {
        "step": 1,
        "split": "train",
        "data_source": "",
        "prompt": "p2",
        "response": "yy",
        "reward": 0.5,
    },
    {"step": 2, "split": "train", "data_source": "b", "prompt": "P3", "response": "z"},
]


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    lines(
        tmp_path / "metrics.jsonl", {"step": 0, "reward/mean": 0.1}, {"step": 1, "reward/mean": 0.2}
    )
    lines(tmp_path / "samples.jsonl", *SAMPLES)
    (tmp_path / "status.json").write_text(json.dumps({"state": "running", "updated": 1.0}))
    return tmp_path


def test_a_directory_that_is_not_a_run_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(NotARun, match=r"is not a run directory: it has none of metrics\.jsonl"):
        RunFiles(tmp_path)
    with pytest.raises(NotARun, match="does not exist"):
        RunFiles(tmp_path / "missing")
    with pytest.raises(NotARun, match="is not a directory"):
        RunFiles(tmp_path / "notes.txt")
    assert cli.main(["view", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridflow: error: RUN_DIR: ") and "is not a run directory" in err


def test_an_older_run_with_metrics_alone_shows_what_it_has(tmp_path):
    lines(tmp_path / "metrics.jsonl", {"step": 0, "reward/mean": 0.5, "timing/step": 1.0})
    run = RunFiles(tmp_path)
    info = run_info(run)
    assert info["files"] == {
        "metrics.jsonl": True,
        "samples.jsonl": False,
        "summary.json": False,
        "status.json": False,
    }
    assert info["status"] is None and info["last_step"] == 0 and info["samples"] == 0
    assert metrics_since(run, {})["rows"] == [{"step": 0, "reward/mean": 0.5, "timing/step": 1.0}]
    assert samples_matching(run, {})["rows"] == [] and samples_matching(run, {})["total"] == 0


def test_metrics_are_read_incrementally_and_a_partial_last_line_waits(run_dir):
    run = RunFiles(run_dir)
    first = metrics_since(run, {})
    assert first["reset"] and first["next"] == 2 and len(first["rows"]) == 2
    gen = str(first["generation"])
    lines(run_dir / "metrics.jsonl", partial='{"step": 2, "reward/me')  # being written
    assert metrics_since(run, {"since": "2", "generation": gen})["rows"] == []
    lines(run_dir / "metrics.jsonl", partial='an": 0.3}\n{"step": 3')
    now = metrics_since(run, {"since": "2", "generation": gen})
    assert not now["reset"] and now["rows"] == [{"step": 2, "reward/mean": 0.3}]
    assert now["start"] == 2 and now["next"] == 3
    lines(run_dir / "metrics.jsonl", partial=', "val/reward/mean": NaN}\nnot json\n[1]\n')
    last = metrics_since(run, {"since": "3", "generation": gen})
    assert last["rows"] == [{"step": 3, "val/reward/mean": None}]  # NaN -> null for JSON
    assert run_info(run)["bad_lines"] == {"metrics": 2, "samples": 0}


def test_a_rewritten_metrics_file_is_read_again_and_says_reset(run_dir):
    run = RunFiles(run_dir)
    gen = str(metrics_since(run, {})["generation"])
    path = run_dir / "metrics.jsonl"
    text = path.read_text()
    path.write_text(text.replace("0.2", "0.9"))  # same length, other bytes (a resumed run)
    again = metrics_since(run, {"since": "2", "generation": gen})
    assert again["reset"] and again["start"] == 0
    assert [r["reward/mean"] for r in again["rows"]] == [0.1, 0.9]
    path.write_text("")  # a fresh run with the same run_dir
    assert metrics_since(run, {"since": "2", "generation": str(again["generation"])})["rows"] == []


def test_run_info_reads_status_and_tolerates_a_half_written_one(run_dir):
    run = RunFiles(run_dir)
    info = run_info(run)
    assert info["status"] == {"state": "running", "updated": 1.0} and info["samples"] == 4
    assert info["last_step"] == 1 and info["train_steps"] == 2
    (run_dir / "status.json").write_text('{"state": "runn')
    assert run_info(run)["status"] is None


def steps_of(query: dict[str, str], run: RunFiles) -> list[tuple[int, str]]:
    return [(r["step"], r["prompt"]) for r in samples_matching(run, query)["rows"]]


def test_samples_filter_by_step_split_source_reward_and_text(run_dir):
    run = RunFiles(run_dir)
    everything = samples_matching(run, {})
    assert everything["steps"] == [2, 1, 0] and everything["splits"] == ["train", "val"]
    assert everything["sources"] == ["", "a", "b"] and everything["matched"] == 4
    assert steps_of({}, run) == [(2, "P3"), (1, "p2"), (0, "p0"), (0, "p1")]  # newest first
    assert steps_of({"step": "0"}, run) == [(0, "p0"), (0, "p1")]
    assert steps_of({"step": "2-1"}, run) == [(2, "P3"), (1, "p2")]
    assert steps_of({"split": "val"}, run) == [(0, "p0")]
    assert steps_of({"source": ""}, run) == [(1, "p2")]  # no data source is a source too
    assert steps_of({"source": "a", "split": "train"}, run) == [(0, "p1")]
    assert steps_of({"min_reward": "0.5"}, run) == [(1, "p2"), (0, "p1")]  # no reward: out
    assert steps_of({"max_reward": "0.5", "min_reward": "0.1"}, run) == [(1, "p2")]
    assert steps_of({"q": "p3"}, run) == [(2, "P3")]  # case-insensitive, prompt or response
    assert steps_of({"q": "yy"}, run) == [(1, "p2")]
    page = samples_matching(run, {"limit": "2", "offset": "1"})
    assert [r["prompt"] for r in page["rows"]] == ["p2", "p0"] and page["matched"] == 4


@pytest.mark.parametrize(
    "query, key",
    [
        ({"step": "x"}, "step"),
        ({"min_reward": "nan"}, "min_reward"),
        ({"max_reward": "high"}, "max_reward"),
        ({"limit": "0"}, "limit"),
        ({"limit": "5000"}, "limit"),
        ({"offset": "-1"}, "offset"),
    ],
)
def test_a_bad_query_parameter_is_named(run_dir, query, key):
    with pytest.raises(BadQuery, match=f"^{key}: "):
        samples_matching(RunFiles(run_dir), query)


def test_the_viewers_file_names_are_the_writers():
    from hybridflow.pipeline.observe import samples
    from hybridflow.pipeline.runtime.watch import status

    assert runfiles.SAMPLES_FILE == samples.SAMPLES_FILE
    assert runfiles.STATUS_FILE == status.STATUS_FILE


@pytest.fixture()
def served(run_dir):
    server = make_server(run_dir, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def get(server: ViewServer, path: str, host: str | None = None, method: str = "GET"):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    headers = {"Host": host} if host else {}
    conn.request(method, path, headers=headers)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp, body


def test_the_page_its_assets_and_the_api_over_http(served):
    resp, body = get(served, "/")
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/html")
    assert b'src="/static/app.js"' in body and b"http" not in body.split(b"<body>")[0]
    csp = resp.getheader("Content-Security-Policy")
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert resp.getheader("Cache-Control") == "no-store"
    for path, (_, ctype) in ASSETS.items():
        r, b = get(served, path)
        assert r.status == 200 and r.getheader("Content-Type") == ctype and b
        assert b"https://" not in b and b"//cdn" not in b  # nothing from elsewhere
    resp, body = get(served, "/api/samples?step=1")
    assert resp.status == 200 and [r["prompt"] for r in json.loads(body)["rows"]] == ["p2"]
    resp, body = get(served, "/api/metrics?since=1&generation=-1")
    assert json.loads(body)["reset"] is True and len(json.loads(body)["rows"]) == 2
    resp, body = get(served, "/api/samples?limit=0")
    assert resp.status == 400 and json.loads(body) == {"error": "limit: 0 is out of range"}
    resp, body = get(served, "/../metrics.jsonl")
    assert resp.status == 404 and b"no such page" in body
    resp, body = get(served, "/api/run", method="HEAD")
    assert resp.status == 200 and body == b"" and int(resp.getheader("Content-Length")) > 0


def test_on_loopback_another_host_header_is_refused(served):
    port = served.server_address[1]
    assert get(served, "/api/run", host=f"localhost:{port}")[0].status == 200
    assert get(served, "/api/run", host=f"[::1]:{port}")[0].status == 200
    resp, body = get(served, "/api/run", host=f"attacker.example:{port}")  # DNS rebinding
    assert resp.status == 403 and b"Host" in body


def ctrl_c(self, **kwargs):
    raise KeyboardInterrupt


def serve_once(monkeypatch, run_dir: Path, host: str, capsys) -> tuple[str, str]:
    """`hybridflow view` up to serving, then Ctrl-C: -> what it printed (out, err)."""
    monkeypatch.setattr(ViewServer, "serve_forever", ctrl_c)
    args = cli._parser().parse_args(["view", str(run_dir), "--host", host, "--port", "0"])
    assert cli_view(args) == 0  # Ctrl-C stops it cleanly
    out = capsys.readouterr()
    return out.out, out.err


def test_loopback_by_default_and_a_non_loopback_bind_warns(run_dir, monkeypatch, capsys):
    args = cli._parser().parse_args(["view", str(run_dir)])
    assert args.host == "127.0.0.1" and args.port == 8600
    out, err = serve_once(monkeypatch, run_dir, "127.0.0.1", capsys)
    assert "on http://127.0.0.1:" in out and err == ""
    out, err = serve_once(monkeypatch, run_dir, "0.0.0.0", capsys)
    assert "not a loopback address" in err and "no authentication" in err


def test_a_port_in_use_is_a_config_error_naming_the_port(served, run_dir):
    with pytest.raises(ConfigError, match=r"^--port: cannot listen on 127\.0\.0\.1:\d+"):
        make_server(run_dir, "127.0.0.1", served.server_address[1])


def test_the_viewer_starts_without_torch():
    code = "import sys, hybridflow.cli, hybridflow.view.server; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

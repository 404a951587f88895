"""The run viewer: `hybridflow view RUN_DIR` serves a local page of one run, live.

    runfiles.py   the run's files read as they grow (metrics.jsonl, samples.jsonl,
                  status.json, summary.json); stdlib only
    server.py     the HTTP server (stdlib ThreadingHTTPServer): the page, its assets, and
                  the JSON endpoints it polls; the CLI entry point
    static/       the page: index.html, app.js (curves drawn as SVG, the timing bars, the
                  samples table), style.css; shipped in the package, nothing from a CDN

Nothing here imports torch or the training stack: the viewer starts in a fraction of a
second beside a running job, and reads a run of any version for what it has.
"""

"""Benchmarks behind `hybridflow bench WHAT --json`; each module exposes run(args) -> dict."""

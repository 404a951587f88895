"""External environment services: an environment class served over HTTP or ZeroMQ, and
the RemoteEnv that a rollout's trajectory loop uses in its place (issue 23, item 5).

    schema.py    the wire structs, version 1 (reset / step / close), validation both ways
    app.py       EnvApp: the server core; sessions, idempotent step ids, bounded calls
    server.py    start_env_server / `hybridflow env-serve pkg.mod:Class`
    client.py    RemoteEnv (`env: remote`): retries, backoff, fallback, named errors

The bytes move through the reward service's machinery (hybridflow/reward/: transports,
the HTTP and ZeroMQ front ends, the serve loop), so both services behave alike. The
protocol is documented for other languages in docs/env-service.md.

Nothing here is imported by `hybridflow.stages.env` itself: the service's dependencies
(aiohttp, zmq) load only when `env: remote` or env-serve is used.
"""

"""External reward services: the wire schema, a client, and a server SDK.

    hybridflow.reward.serve(fn, protocol="http"|"zmq", host="127.0.0.1", port=8000)
    hybridflow.reward.start_server(...)     # the same, non-blocking, inside an event loop
    hybridflow.reward.RewardClient          # used by the `http` / `zmq` reward backends

Modules: schema (wire structs + validation, one place), client (batching, retries,
failure policy), transports (aiohttp / DEALER), app (server core), http_server,
zmq_server, server (serve / start_server / CLI). The protocol is documented for
other languages in docs/reward-service.md.

Imports are lazy so `import hybridflow.reward.schema` never pulls in aiohttp.
"""

from __future__ import annotations

__all__ = ["ClientConfig", "FallbackPolicy", "RewardClient", "make_client", "serve", "start_server"]


def __getattr__(name: str):  # PEP 562
    if name in ("serve", "start_server"):
        from hybridflow.reward import server

        return getattr(server, name)
    if name in ("ClientConfig", "FallbackPolicy", "RewardClient", "make_client"):
        from hybridflow.reward import client

        return getattr(client, name)
    raise AttributeError(f"module 'hybridflow.reward' has no attribute {name!r}")

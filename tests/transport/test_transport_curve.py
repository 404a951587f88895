"""CurveZMQ (transport/curve.py): only the run's clients get a message into a Curve server.

- a client with the run's keys is heard; a plain client, a Curve client with a key of
  another run, and one with a wrong server key never are; the gate counts refusals;
- keys survive the payload round trip (JSON text only);
- loopback runs make no keys (`needed`), so their sockets stay plain;
- the gate thread stops when the last Curve server socket of the context closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
import zmq

from hybridflow.errors import TransportTimeout
from hybridflow.transport import curve, protocol
from hybridflow.transport.channel import Channel
from hybridflow.transport.protocol import Ping

pytestmark = pytest.mark.skipif(not curve.available(), reason="libzmq without CurveZMQ")


def _raw_dealer(endpoint: str, keys: tuple[bytes, bytes, bytes] | None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        server_public, public, secret = keys
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.connect(endpoint)
    return sock


async def test_only_the_runs_clients_get_a_message_in() -> None:
    run = curve.RunKeys.new(["reward/0"], "run-a")
    other = curve.RunKeys.new(["reward/0"], "run-b")
    server = Channel(
        "router",
        "tcp://127.0.0.1:0",
        bind=True,
        name="coordinator",
        curve_keys=run.for_server(),
    )
    assert server._sock.getsockopt(zmq.CURVE_SERVER) == 1  # a Curve server, from the keys
    gate = curve.ZapGate.of(zmq.Context.instance())
    strangers = []
    try:
        mine = other.for_process("reward/0")
        strangers = [
            _raw_dealer(server.endpoint, None),  # no Curve at all
            _raw_dealer(server.endpoint, (run.server[0], mine.public, mine.secret)),  # other run
            _raw_dealer(server.endpoint, (other.server[0], *run.clients["reward/0"])),  # bad server
        ]
        for sock in strangers:  # a refused handshake leaves nothing to queue on: no wait
            with contextlib.suppress(zmq.Again):
                sock.send_multipart(protocol.encode(Ping(seq=1, t_ns=1)), zmq.NOBLOCK)
        with pytest.raises(TransportTimeout):
            await server.recv(timeout=1.0)
        assert server.refused >= 1  # the other run's client reached the gate, and was refused

        client = Channel(
            "dealer",
            server.endpoint,
            bind=False,
            name="reward/0",
            curve_keys=run.for_process("reward/0"),
        )
        try:
            await client.send(Ping(seq=2, t_ns=2), timeout=5)
            got = await server.recv(timeout=5)
            assert isinstance(got.msg, Ping) and got.msg.seq == 2
        finally:
            client.close()
        assert gate.admitted.get("run-a", 0) >= 1
    finally:
        for sock in strangers:
            sock.close(0)
        server.close()
    await asyncio.sleep(0)
    assert gate._thread is None  # the last Curve server closed: the gate stopped


def test_keys_travel_as_json_and_loopback_runs_make_none() -> None:
    run = curve.RunKeys.new(["a/0", "b/0"], "r")
    keys = run.for_process("a/0")
    back = curve.CurveKeys.from_payload(json.loads(json.dumps(keys.to_payload())))
    assert back == keys and back.secret == run.clients["a/0"][1]
    assert keys.allowed == {run.clients["a/0"][0], run.clients["b/0"][0]}
    assert keys.secret.decode() not in repr(keys)
    assert keys.server_secret.decode() not in repr(keys)
    assert not curve.needed("tcp", "127.0.0.1") and not curve.needed("ipc", "10.0.0.1")
    assert curve.needed("tcp", "10.0.0.1") and curve.needed("tcp", "node1.example")

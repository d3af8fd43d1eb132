"""A wrong address is known at once, and the error says what is wrong with it.

What a user mistypes or mixes up: a tcp address without a port or with one out of range, a
host that does not resolve, an empty ipc path, and the HTTP port given to the ZeroMQ client
(something accepts the connection, nothing answers zmq's handshake).
"""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
import time

import pytest

from frontend import AsyncClient, Client
from frontend.client import transport
from frontend.client.outputs import EngineDeadError


@pytest.mark.parametrize(("address", "why"), [
    ("tcp://127.0.0.1", "no HOST:PORT"),
    ("tcp://:5555", "no HOST:PORT"),
    ("tcp://127.0.0.1:99999", "port '99999' is not in 1..65535"),
    ("tcp://127.0.0.1:http", "port 'http' is not in 1..65535"),
    ("ipc://", "no socket path"),
    ("ipc://@", "no socket name after '@'"),
])
def test_a_malformed_address_is_a_value_error_that_says_why(address, why):
    with pytest.raises(ValueError, match=f"is not a pipeline address: {why}.*clients connect"):
        Client(address)
    with pytest.raises(ValueError, match=why):
        asyncio.run(AsyncClient(address).start())


def test_a_host_that_does_not_resolve_is_named():
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="the host 'no-such-host.invalid' does not resolve"):
        Client("tcp://no-such-host.invalid:5555")
    assert time.monotonic() - start < 30  # the resolver's own answer, not a handshake timeout


def test_ip_literals_are_not_looked_up():
    with pytest.raises(EngineDeadError, match="connection was refused"):
        Client(f"tcp://[::1]:{_free_port()}" if socket.has_ipv6 else
               f"tcp://127.0.0.1:{_free_port()}")


class SilentListener:
    """A tcp port whose backlog accepts connections that nobody reads."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]

    def close(self) -> None:
        self.sock.close()


class HTTPListener:
    """An HTTP server: it waits for a request line that zmq's greeting never ends."""

    def __init__(self) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                      http.server.BaseHTTPRequestHandler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("listener_type", [SilentListener, HTTPListener], ids=["silent", "http"])
def test_a_port_that_does_not_speak_zmq_fails_the_first_handshake(monkeypatch, listener_type):
    monkeypatch.setattr(transport, "FIRST_HANDSHAKE_MS", 500)
    listener = listener_type()
    address = f"tcp://127.0.0.1:{listener.port}"
    try:
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="did not answer ZeroMQ's handshake") as err:
            Client(address)
        assert "an HTTP port?" in str(err.value) and address in str(err.value)
        with pytest.raises(EngineDeadError, match="did not answer ZeroMQ's handshake"):
            asyncio.run(AsyncClient(address).start())
        assert time.monotonic() - start < 20  # not zmq's 30 s handshake, not the 60 s connect
    finally:
        listener.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

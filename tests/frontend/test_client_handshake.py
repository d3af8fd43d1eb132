"""A pipeline that drops the connection in the middle of the handshake fails both clients
after the disconnect grace, with the same reason, instead of holding them until
connect_timeout."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from frontend import AsyncClient, Client, EngineDeadError
from frontend.client.core import DISCONNECT_GRACE_S

CONNECT_TIMEOUT_S = 30.0


class HangUpServer:
    """Accepts a client's hello on the requests socket, then closes without a welcome."""

    def __init__(self, tmp_path) -> None:
        self.ctx = zmq.Context()
        self.address = f"ipc://{tmp_path}/requests"
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(self.address)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        if self.sock.poll(20_000):
            self.sock.recv_multipart()
        self.sock.close(linger=0)

    def close(self) -> None:
        self.thread.join(25)
        self.ctx.term()


def _sync(address: str) -> None:
    Client(address, connect_timeout=CONNECT_TIMEOUT_S)


def _async(address: str) -> None:
    asyncio.run(AsyncClient(address, connect_timeout=CONNECT_TIMEOUT_S).start())


@pytest.mark.parametrize("connect", [_sync, _async], ids=["Client", "AsyncClient"])
def test_a_connection_lost_during_the_handshake_fails_after_the_grace(tmp_path, connect):
    server = HangUpServer(tmp_path)
    try:
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="lost the connection to the pipeline at"):
            connect(server.address)
        assert time.monotonic() - start < DISCONNECT_GRACE_S + 5
    finally:
        server.close()

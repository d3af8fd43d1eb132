"""The client library never waits forever: a wrong address fails at once, an oversized
request is refused before it is sent, and an error that names no request fails the
requests it may belong to. A stand-in server (two ROUTERs in a thread) plays the pipeline."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import zmq

from frontend import AsyncClient, Client, EngineDeadError, RequestRejected
from frontend.actors.replies import error_delta, malformed
from protocol import (
    MAX_FRAME_BYTES,
    AbortRequest,
    ClientHello,
    ClientWelcome,
    Decoder,
    FinishReason,
    GenerateRequest,
    ResultDelta,
    encode,
)


class StandInServer:
    """Welcomes a client on both sockets. After `expect` requests it answers the first with a
    partial delta, then sends one error with an empty request id; it finishes the first
    request when that request is the only one left."""

    def __init__(self, tmp_path, expect: int) -> None:
        self.ctx = zmq.Context()
        self.address = f"ipc://{tmp_path}/requests"
        self.results_address = f"ipc://{tmp_path}/results"
        self.requests = self.ctx.socket(zmq.ROUTER)
        self.requests.bind(self.address)
        self.results = self.ctx.socket(zmq.ROUTER)
        self.results.bind(self.results_address)
        self.expect = expect
        self.generate: list[str] = []
        self.aborted: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        decoder = Decoder(ClientHello, GenerateRequest, AbortRequest)
        poller = zmq.Poller()
        poller.register(self.requests, zmq.POLLIN)
        poller.register(self.results, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(50):
                peer, frame = sock.recv_multipart()
                msg = decoder.decode(frame)
                if isinstance(msg, ClientHello):
                    sock.send_multipart([peer, encode(ClientWelcome(
                        self.results_address, "stand-in", 128))])
                elif isinstance(msg, GenerateRequest):
                    self.generate.append(msg.client_request_id)
                    if len(self.generate) == self.expect:
                        first = self.generate[0]
                        self._send(peer, ResultDelta(first, "a", [1], None, 1, 1, None, None))
                        self._send(peer, error_delta("", malformed("lost its id")))
                else:
                    self.aborted.append(msg.client_request_id)
                    if len(self.aborted) == self.expect - 1:
                        first = self.generate[0]
                        self._send(peer, ResultDelta(first, "b", [2], FinishReason.LENGTH,
                                                     1, 2, None, None))

    def _send(self, peer: bytes, msg) -> None:
        self.requests.send_multipart([peer, encode(msg)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.requests.close(linger=0)
        self.results.close(linger=0)
        self.ctx.term()


@pytest.fixture
def server(tmp_path):
    srv = StandInServer(tmp_path, expect=3)
    yield srv
    srv.close()


def test_an_error_without_request_id_fails_every_unanswered_request(server):
    with Client(server.address, timeout=10) as client:
        stream = client.stream("first")  # sent now, so the server sees it first
        errors: list[BaseException] = []

        def other() -> None:
            try:
                client.generate("other")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=other) for _ in range(2)]
        for t in threads:
            t.start()
        assert next(stream).text == "a"  # answered: it cannot be the one refused
        for t in threads:
            t.join(10)
        assert len(errors) == 2 and all(isinstance(e, RequestRejected) for e in errors)
        assert all("could not read" in str(e) and "lost its id" in str(e) for e in errors)
        assert [d.text for d in stream] == ["b"]  # the answered request goes on
    assert set(server.aborted) == set(server.generate[1:])


def test_async_client_fails_unanswered_requests_on_an_error_without_id(server):
    async def main() -> None:
        async with AsyncClient(server.address, timeout=10) as client:
            stream = client.stream("first")
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.2)  # the server sees it first
            results = await asyncio.gather(client.generate("x"), client.generate("y"),
                                           return_exceptions=True)
            assert (await first).text == "a"
            assert all(isinstance(r, RequestRejected) and "lost its id" in str(r)
                       for r in results)
            assert [d.text async for d in stream] == ["b"]

    asyncio.run(asyncio.wait_for(main(), 30))
    assert set(server.aborted) == set(server.generate[1:])


def test_a_request_over_the_frame_limit_is_refused_before_it_is_sent(server):
    huge = "x" * (MAX_FRAME_BYTES + 1)
    with Client(server.address, timeout=10) as client:
        with pytest.raises(RequestRejected, match="^prompt: the request encodes to"):
            client.generate(huge)
        with pytest.raises(RequestRejected, match="^messages: the request encodes to"):
            client.generate(messages=[{"role": "user", "content": huge}])

    async def main() -> None:
        async with AsyncClient(server.address, timeout=10) as client:
            with pytest.raises(RequestRejected, match="^prompt: the request encodes to"):
                await client.generate(huge)

    asyncio.run(main())
    assert server.generate == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _addresses(tmp_path) -> dict[str, tuple[str, str]]:
    (tmp_path / "file").write_text("not a socket")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "stale"))  # a socket file nobody listens on
    stale.close()
    return {
        "missing": (f"ipc://{tmp_path}/missing", "No such file"),
        "file": (f"ipc://{tmp_path}/file", "is not a socket"),
        "stale": (f"ipc://{tmp_path}/stale", "connection was refused"),
        "tcp": (f"tcp://127.0.0.1:{_free_port()}", "connection was refused"),
    }


@pytest.mark.parametrize("kind", ["missing", "file", "stale", "tcp"])
def test_a_wrong_address_fails_at_once(tmp_path, kind):
    address, message = _addresses(tmp_path)[kind]
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=message):
        Client(address)  # connect_timeout is 60 s
    with pytest.raises(EngineDeadError, match=message):
        asyncio.run(AsyncClient(address).start())
    assert time.monotonic() - start < 5

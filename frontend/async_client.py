"""asyncio client of a running pipeline (zmq.asyncio; uvloop works if the caller installs it).

Same wire conversation as `Client`: one reader task owns the receive side of both DEALER
sockets and their monitors and routes deltas into per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from frontend.client import (
    CLOSE_LINGER_MS,
    CONNECT_TIMEOUT_S,
    configure_context,
    error_for,
    is_disconnect,
    make_decoder,
    make_request,
    to_delta,
)
from frontend.outputs import (
    ClientClosedError,
    EngineDeadError,
    OutputCollector,
    RequestDelta,
    RequestOutput,
)
from protocol import (
    AbortRequest,
    ClientHello,
    ClientWelcome,
    EngineDead,
    ProtocolError,
    ResultDelta,
    ResultDeltaBatch,
    SamplingParams,
    encode,
)


class AsyncClient:
    """Connects on first use (or `await client.start()` / `async with`)."""

    def __init__(self, address: str, timeout: float | None = None, *,
                 connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.address = address
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.client_id = uuid.uuid4().hex
        self.welcome: ClientWelcome | None = None
        self._decoder = make_decoder()
        self._ctx: zmq.asyncio.Context | None = None
        self._sockets: list[zmq.asyncio.Socket] = []
        self._monitors: list[zmq.asyncio.Socket] = []
        self._requests: zmq.asyncio.Socket | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._start_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None
        self._closed = False

    @property
    def dead(self) -> bool:
        """True once the pipeline is known to be gone (requests then raise EngineDeadError)."""
        return self._dead is not None

    # ---------------------------------------------------------- connection

    async def start(self) -> None:
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self.welcome is not None:
                return
            if self._closed:
                raise ClientClosedError("the client is closed")
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            self._loop = asyncio.get_running_loop()
            self._ctx = zmq.asyncio.Context()
            configure_context(self._ctx)
            try:
                await asyncio.wait_for(self._handshake(), self.connect_timeout)
            except (asyncio.TimeoutError, EngineDeadError) as exc:
                reason = (str(exc) if isinstance(exc, EngineDeadError) else
                          f"no pipeline answered at {self.address} "
                          f"within {self.connect_timeout}s")
                self._dead = reason
                self._release()
                raise EngineDeadError(reason) from None
            self._reader = asyncio.ensure_future(self._read_loop())

    async def _handshake(self) -> None:
        self._requests = self._dealer(self.address)
        welcome = await self._await_welcome(self._requests)
        results = self._dealer(welcome.results_address)
        await self._await_welcome(results)
        self.welcome = welcome

    def _dealer(self, address: str) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.client_id.encode())
        self._monitors.append(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        sock.connect(address)
        sock.send(encode(ClientHello(self.client_id)), zmq.NOBLOCK)
        self._sockets.append(sock)
        return sock

    async def _await_welcome(self, sock: zmq.asyncio.Socket) -> ClientWelcome:
        while True:
            frames = await sock.recv_multipart()
            try:
                msg = self._decoder.decode(frames[-1])
            except ProtocolError:
                continue
            if isinstance(msg, ClientWelcome):
                return msg
            if isinstance(msg, EngineDead):
                raise EngineDeadError(msg.reason)

    async def _read_loop(self) -> None:
        poller = zmq.asyncio.Poller()
        for sock in (*self._sockets, *self._monitors):
            poller.register(sock, zmq.POLLIN)
        try:
            while True:
                for sock, _ in await poller.poll():
                    frames = await sock.recv_multipart()
                    if sock in self._monitors:
                        if is_disconnect(frames):
                            self._fail_all(f"lost the connection to the pipeline at "
                                           f"{self.address}")
                    else:
                        self._on_frame(frames[-1])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave callers waiting on a dead reader
            self._fail_all(f"client I/O failed: {exc!r}")

    def _on_frame(self, frame: bytes) -> None:
        try:
            msg = self._decoder.decode(frame)
        except ProtocolError:
            return
        if isinstance(msg, EngineDead):
            self._fail_all(msg.reason)
        elif isinstance(msg, ResultDeltaBatch):
            for delta in msg.deltas:
                self._on_delta(delta)
        elif isinstance(msg, ResultDelta):
            self._on_delta(msg)

    def _on_delta(self, msg: ResultDelta) -> None:
        q = self._queues.get(msg.client_request_id)
        if q is None:
            return
        if msg.finish_reason is not None:
            del self._queues[msg.client_request_id]
        q.put_nowait(error_for(msg.error) if msg.error is not None else to_delta(msg))

    def _fail_all(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(reason))
        self._queues.clear()

    # ---------------------------------------------------------- public API

    async def generate(self, prompt: str | None = None, *, prompt_token_ids: Any = None,
                       messages: Any = None,
                       params: SamplingParams | None = None) -> RequestOutput:
        request_id, q = await self._submit(prompt, prompt_token_ids, messages, params, False)
        collector = OutputCollector(request_id)
        try:
            while True:
                delta = await self._next(request_id, q)
                collector.add(delta)
                if delta.finish_reason is not None:
                    return collector.output()
        except BaseException:
            self._abort_nowait(request_id)
            raise

    def stream(self, prompt: str | None = None, *, prompt_token_ids: Any = None,
               messages: Any = None, params: SamplingParams | None = None) -> AsyncResultStream:
        """An async iterator of deltas; aclose(), cancellation or dropping it aborts."""
        frame_args = (prompt, prompt_token_ids, messages, params, True)
        return AsyncResultStream(self, frame_args)

    async def abort(self, request_id: str) -> None:
        self._abort_nowait(request_id)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for request_id, q in list(self._queues.items()):
            self._abort_nowait(request_id)
            q.put_nowait(ClientClosedError(f"request {request_id}: the client was closed"))
        self._queues.clear()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._release()

    def _release(self) -> None:
        for sock in self._sockets:
            sock.disable_monitor()
        for monitor in self._monitors:
            monitor.close(linger=0)
        for sock in self._sockets:
            connected = sock is self._requests and self.welcome is not None
            sock.close(linger=CLOSE_LINGER_MS if connected else 0)
        self._sockets.clear()
        self._monitors.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> AsyncClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---------------------------------------------------------- internals

    async def _submit(self, prompt: str | None, prompt_token_ids: Any, messages: Any,
                      params: SamplingParams | None, stream: bool) -> tuple[str, asyncio.Queue]:
        await self.start()
        request_id = uuid.uuid4().hex
        frame = make_request(request_id, prompt, prompt_token_ids, messages, params, stream)
        if self._closed:
            raise ClientClosedError("the client is closed")
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        assert self._requests is not None
        self._requests.send(frame, zmq.NOBLOCK)
        return request_id, q

    async def _next(self, request_id: str, q: asyncio.Queue) -> RequestDelta:
        try:
            item = await asyncio.wait_for(q.get(), self.timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"request {request_id}: no result within {self.timeout}s") \
                from None
        if isinstance(item, BaseException):
            raise item
        return item

    def _abort_nowait(self, request_id: str) -> None:
        """Forget the request and tell the engine; safe from finalizers and other threads."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop:
            loop.call_soon_threadsafe(self._abort_nowait, request_id)
            return
        self._queues.pop(request_id, None)
        if self._requests is not None and not self._requests.closed and self._dead is None:
            with contextlib.suppress(zmq.ZMQError):
                self._requests.send(encode(AbortRequest(request_id)), zmq.NOBLOCK)


class AsyncResultStream(AsyncIterator[RequestDelta]):
    """Deltas of one streaming request, submitted on the first iteration."""

    def __init__(self, client: AsyncClient, frame_args: tuple) -> None:
        self.client = client
        self._args = frame_args
        self.request_id: str | None = None
        self._q: asyncio.Queue | None = None
        self._done = False

    def __aiter__(self) -> AsyncResultStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self._done:
            raise StopAsyncIteration
        if self._q is None:
            self.request_id, self._q = await self.client._submit(*self._args)
        assert self.request_id is not None
        try:
            delta = await self.client._next(self.request_id, self._q)
        except BaseException:  # cancellation included: the engine must stop generating
            await self.aclose()
            raise
        if delta.finish_reason is not None:
            self._done = True
        return delta

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            if self.request_id is not None:
                self.client._abort_nowait(self.request_id)

    def __del__(self) -> None:
        if not self._done and self.request_id is not None:
            self._done = True
            with contextlib.suppress(Exception):
                self.client._abort_nowait(self.request_id)

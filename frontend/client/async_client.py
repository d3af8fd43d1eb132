"""asyncio client of a running pipeline (zmq.asyncio; uvloop works if the caller installs it).

Same wire conversation as `Client`: one reader task owns the receive side of both DEALER
sockets and their monitors and routes deltas into per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from frontend.client.outputs import (
    ClientClosedError,
    EngineDeadError,
    OutputCollector,
    RequestDelta,
    RequestOutput,
    RequestRejected,
)
from frontend.client.sync_client import (
    CLOSE_LINGER_MS,
    CONNECT_TIMEOUT_S,
    DISCONNECT_GRACE_S,
    MONITOR_EVENTS,
    ORPHAN_ERROR,
    ConnectionInfo,
    HandshakeWatch,
    check_address,
    configure_context,
    error_for,
    make_decoder,
    make_request,
    monitor_event,
    refused,
    to_delta,
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


class AsyncClient(ConnectionInfo):
    """Connects on first use (or `await client.start()` / `async with`). Close it, or use it as
    an async context manager; one dropped while its loop still runs is closed on that loop."""

    def __init__(self, address: str, timeout: float | None = None, *,
                 connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.address = address
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._conn = _AsyncConnection(address)
        # The reader task holds the connection, never the client: dropping the client frees it.
        self._finalizer = weakref.finalize(self, self._conn.close_soon)
        self._start_lock: asyncio.Lock | None = None

    # ---------------------------------------------------------- connection

    async def start(self) -> None:
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        conn = self._conn
        async with self._start_lock:
            if conn.welcome is not None:
                return
            if conn.closed:
                raise ClientClosedError("the client is closed")
            if conn.dead is not None:
                raise EngineDeadError(conn.dead)
            check_address(self.address)
            conn.open(asyncio.get_running_loop())
            try:
                await asyncio.wait_for(conn.handshake(), self.connect_timeout)
            except (asyncio.TimeoutError, EngineDeadError) as exc:
                reason = (str(exc) if isinstance(exc, EngineDeadError) else
                          f"no pipeline answered at {self.address} "
                          f"within {self.connect_timeout}s")
                conn.dead = reason
                conn.release()
                raise EngineDeadError(reason) from None
            conn.reader = asyncio.ensure_future(conn.read_loop())

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
        self._finalizer.detach()
        await self._conn.aclose()

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
        conn = self._conn
        if conn.closed:
            raise ClientClosedError("the client is closed")
        if conn.dead is not None:
            raise EngineDeadError(conn.dead)
        q: asyncio.Queue = asyncio.Queue()
        conn.queues[request_id] = q
        conn.unanswered.add(request_id)
        assert conn.requests is not None
        conn.requests.send(frame, zmq.NOBLOCK)
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
        self._conn.abort_nowait(request_id)


class _AsyncConnection:
    """The sockets, queues and reader of one AsyncClient, on the loop that opened them."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.client_id = uuid.uuid4().hex
        self.welcome: ClientWelcome | None = None
        self.decoder = make_decoder()
        self.ctx: zmq.asyncio.Context | None = None
        self.sockets: list[zmq.asyncio.Socket] = []
        self.monitors: list[zmq.asyncio.Socket] = []
        self.requests: zmq.asyncio.Socket | None = None
        self.queues: dict[str, asyncio.Queue] = {}
        self.unanswered: set[str] = set()
        """Requests sent that have had no delta yet (see ORPHAN_ERROR in client.py)."""
        self.reader: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.dead: str | None = None
        self.closed = False
        self._closing: asyncio.Task | None = None

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.ctx = zmq.asyncio.Context()
        configure_context(self.ctx)

    async def handshake(self) -> None:
        self.requests = self._dealer(self.address)
        welcome = await self._await_welcome(self.requests, self.address)
        results = self._dealer(welcome.results_address)
        await self._await_welcome(results, welcome.results_address)
        self.welcome = welcome

    def _dealer(self, address: str) -> zmq.asyncio.Socket:
        assert self.ctx is not None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.client_id.encode())
        self.monitors.append(sock.get_monitor_socket(MONITOR_EVENTS))
        sock.connect(address)
        sock.send(encode(ClientHello(self.client_id)), zmq.NOBLOCK)
        self.sockets.append(sock)
        return sock

    async def _await_welcome(self, sock: zmq.asyncio.Socket, address: str) -> ClientWelcome:
        """The socket's welcome; EngineDeadError at once if nothing listens at `address`."""
        monitor = self.monitors[self.sockets.index(sock)]
        watch = HandshakeWatch()
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            for ready, _ in await poller.poll():
                frames = await ready.recv_multipart()
                if ready is monitor:
                    if watch.gave_up(monitor_event(frames)):
                        raise EngineDeadError(refused(address))
                    continue
                try:
                    msg = self.decoder.decode(frames[-1])
                except ProtocolError:
                    continue
                if isinstance(msg, ClientWelcome):
                    return msg
                if isinstance(msg, EngineDead):
                    raise EngineDeadError(msg.reason)

    async def read_loop(self) -> None:
        poller = zmq.asyncio.Poller()
        for sock in (*self.sockets, *self.monitors):
            poller.register(sock, zmq.POLLIN)
        try:
            lost_at: float | None = None
            while True:
                timeout_ms = None
                if lost_at is not None:
                    left = lost_at + DISCONNECT_GRACE_S - time.monotonic()
                    if left <= 0:
                        lost_at = None
                        self.fail_all(f"lost the connection to the pipeline at "
                                      f"{self.address}")
                    else:
                        timeout_ms = int(left * 1000) + 1
                for sock, _ in await poller.poll(timeout_ms):
                    frames = await sock.recv_multipart()
                    if sock in self.monitors:
                        # Wait briefly for the EngineDead that names the dead process
                        # (see DISCONNECT_GRACE_S) before failing with a bare disconnect.
                        if (monitor_event(frames) == zmq.EVENT_DISCONNECTED
                                and lost_at is None and self.dead is None):
                            lost_at = time.monotonic()
                    else:
                        self._on_frame(frames[-1])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave callers waiting on a dead reader
            self.fail_all(f"client I/O failed: {exc!r}")

    def _on_frame(self, frame: bytes) -> None:
        try:
            msg = self.decoder.decode(frame)
        except ProtocolError:
            return
        if isinstance(msg, EngineDead):
            self.fail_all(msg.reason)
        elif isinstance(msg, ResultDeltaBatch):
            for delta in msg.deltas:
                self._on_delta(delta)
        elif isinstance(msg, ResultDelta):
            self._on_delta(msg)

    def _on_delta(self, msg: ResultDelta) -> None:
        if msg.error is not None and not msg.client_request_id:
            self._fail_unanswered(msg.error.message)
            return
        self.unanswered.discard(msg.client_request_id)
        q = self.queues.get(msg.client_request_id)
        if q is None:
            return
        if msg.finish_reason is not None:
            del self.queues[msg.client_request_id]
        q.put_nowait(error_for(msg.error) if msg.error is not None else to_delta(msg))

    def fail_all(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
        for q in self.queues.values():
            q.put_nowait(EngineDeadError(reason))
        self.queues.clear()
        self.unanswered.clear()

    def _fail_unanswered(self, error: str) -> None:
        for request_id in sorted(self.unanswered):
            q = self.queues.get(request_id)
            if q is not None:
                self.abort_nowait(request_id)
                q.put_nowait(RequestRejected(ORPHAN_ERROR + error))
        self.unanswered.clear()

    def abort_nowait(self, request_id: str) -> None:
        """Forget the request and tell the engine; safe from finalizers and other threads."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop:
            loop.call_soon_threadsafe(self.abort_nowait, request_id)
            return
        self.queues.pop(request_id, None)
        self.unanswered.discard(request_id)
        if self.requests is not None and not self.requests.closed and self.dead is None:
            with contextlib.suppress(zmq.ZMQError):
                self.requests.send(encode(AbortRequest(request_id)), zmq.NOBLOCK)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        for request_id, q in list(self.queues.items()):
            self.abort_nowait(request_id)
            q.put_nowait(ClientClosedError(f"request {request_id}: the client was closed"))
        self.queues.clear()
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader
        self.release()

    def close_soon(self) -> None:
        """The client was dropped unclosed: close on its loop, if that loop still runs."""
        loop = self.loop
        if self.closed or loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
            loop.call_soon_threadsafe(self._begin_close)

    def _begin_close(self) -> None:
        self._closing = asyncio.ensure_future(self.aclose())  # the loop keeps only weak refs

    def release(self) -> None:
        for sock in self.sockets:
            sock.disable_monitor()
        for monitor in self.monitors:
            monitor.close(linger=0)
        for sock in self.sockets:
            connected = sock is self.requests and self.welcome is not None
            sock.close(linger=CLOSE_LINGER_MS if connected else 0)
        self.sockets.clear()
        self.monitors.clear()
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None


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

"""asyncio client of a running pipeline (zmq.asyncio; uvloop works if the caller installs it).

Same ClientCore as `Client`: one reader task owns the receive side of both DEALER sockets and
their monitors, feeds the core, and the core routes deltas into per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Mapping
from typing import Any

import zmq
import zmq.asyncio

from frontend.client.core import (
    CONNECT_TIMEOUT_S,
    Action,
    ClientCore,
    Open,
    Phase,
    Reset,
)
from frontend.client.frames import make_request
from frontend.client.info import ConnectionInfo
from frontend.client.outputs import (
    ClientClosedError,
    ConnectionLostError,
    EngineDeadError,
    OutputCollector,
    RequestDelta,
    RequestOutput,
)
from frontend.client.transport import Links, check_address, monitor_event
from protocol.sampling_params import SamplingParamsLike


class AsyncClient(ConnectionInfo):
    """Connects on first use (or `await client.start()` / `async with`). Close it, or use it as
    an async context manager; one dropped while its loop still runs is closed on that loop."""

    def __init__(self, address: str, timeout: float | None = None, *,
                 connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.address = address
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._conn = _AsyncConnection(address)
        self._core = self._conn.core
        # The reader task holds the connection, never the client: dropping the client frees it.
        self._finalizer = weakref.finalize(self, self._conn.close_soon)
        self._start_lock: asyncio.Lock | None = None

    async def start(self) -> None:
        started_on = self._conn.loop
        if started_on is not None and started_on is not asyncio.get_running_loop():
            # Its sockets and reader live on that loop: a request made here would wait forever.
            raise RuntimeError("this AsyncClient belongs to the event loop it started on; "
                               "make one per event loop (each asyncio.run starts a new one)")
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        core = self._core
        async with self._start_lock:
            if core.phase is Phase.READY:
                return
            if core.closed:
                raise ClientClosedError("the client is closed")
            if core.dead is not None:
                raise EngineDeadError(core.dead)
            if core.lost is not None:  # reconnecting: the reader is at it
                raise ConnectionLostError(core.lost)
            check_address(self.address)
            await self._conn.connect(asyncio.get_running_loop(), self.connect_timeout)

    # ---------------------------------------------------------- public API

    async def generate(self, prompt: str | None = None, params: SamplingParamsLike | None = None,
                       *, prompt_token_ids: Any = None, messages: Any = None,
                       client_key: str | None = None,
                       chat_template_kwargs: Mapping[str, Any] | None = None) -> RequestOutput:
        """The whole output. `client_key` names a client of its own within this connection
        (a server relaying many users), for the engine's fair sharing between clients;
        `chat_template_kwargs`, with messages, the chat template's extra variables
        (protocol.template_kwargs)."""
        request_id, q = await self._submit(prompt, prompt_token_ids, messages, params, False,
                                           client_key, chat_template_kwargs)
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

    def stream(self, prompt: str | None = None, params: SamplingParamsLike | None = None,
               *, prompt_token_ids: Any = None, messages: Any = None,
               client_key: str | None = None,
               chat_template_kwargs: Mapping[str, Any] | None = None) -> AsyncResultStream:
        """An async iterator of deltas; aclose(), cancellation or dropping it aborts."""
        frame_args = (prompt, prompt_token_ids, messages, params, True, client_key,
                      chat_template_kwargs)
        return AsyncResultStream(self, frame_args)

    async def abort(self, request_id: str) -> None:
        """Ask the engine to stop a request; it then finishes with finish_reason "abort"."""
        self._conn.abort_nowait(request_id, forget=False)

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
                      params: SamplingParamsLike | None, stream: bool,
                      client_key: str | None = None,
                      chat_template_kwargs: Mapping[str, Any] | None = None
                      ) -> tuple[str, asyncio.Queue]:
        await self.start()
        request_id = uuid.uuid4().hex
        frame = make_request(request_id, prompt, prompt_token_ids, messages, params, stream,
                             client_key, chat_template_kwargs)
        q: asyncio.Queue = asyncio.Queue()
        while wait := self._core.explaining_s(time.monotonic()):
            await asyncio.sleep(min(wait, 0.05))
        self._core.submit(request_id, q.put_nowait)
        self._conn.send(frame)
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
    """The sockets and reader of one AsyncClient, on the loop that opened them."""

    def __init__(self, address: str) -> None:
        self.core = ClientCore(address)
        self.ctx: zmq.asyncio.Context | None = None
        self.poller = zmq.asyncio.Poller()
        self.links = Links(self.poller)
        self.reader: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self._closing: asyncio.Task | None = None

    @property
    def closed(self) -> bool:
        return self.core.closed

    async def connect(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        """Run the handshake; EngineDeadError (and everything released) if it fails."""
        core = self.core
        if self.reader is None:  # else a cancelled start() left the handshake running
            self.loop = loop
            self.ctx = zmq.asyncio.Context()
            self._ready = asyncio.Event()
            self._apply([core.start()])
            self.reader = asyncio.ensure_future(self._read_loop())
        assert self._ready is not None
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            core.fail_all(f"no pipeline answered at {core.address} within {timeout}s")
        if core.phase is not Phase.READY:
            try:
                await self._stop_reader()
            finally:  # a cancelled connect releases too
                self.release()
            raise EngineDeadError(core.dead)

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Open):
                assert self.ctx is not None
                self.links.open(self.ctx, self.core, action)
            elif isinstance(action, Reset):
                self.links.close(connected=False)
            else:
                self.send(action.frame)

    def send(self, frame: bytes) -> None:
        self.links.send_request(frame)

    async def _read_loop(self) -> None:
        core = self.core
        assert self._ready is not None
        try:
            while True:
                self._apply(core.on_timer(time.monotonic()))
                wait = core.wait_s(time.monotonic())
                timeout_ms = None if wait is None else int(wait * 1000) + 1
                if not core.handshaking:
                    self._ready.set()
                for sock, _ in await self.poller.poll(timeout_ms):
                    if sock.closed:
                        continue  # closed by a reconnection earlier in this batch
                    frames = await sock.recv_multipart()
                    if (monitored := self.links.monitored(sock)) is not None:
                        core.on_monitor(monitored, monitor_event(frames), time.monotonic())
                    else:
                        self._apply(core.on_frame(self.links.link(sock), frames[-1]))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave callers waiting on a dead reader
            core.fail_all(f"client I/O failed: {exc!r}")
        finally:
            self._ready.set()

    def abort_nowait(self, request_id: str, forget: bool = True) -> None:
        """Tell the engine to stop the request; safe from finalizers and other threads.

        `forget`: nobody reads the request any more (a dropped stream, a cancelled task), so
        its last delta is dropped; otherwise the reader still gets its "abort"."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop:
            loop.call_soon_threadsafe(self.abort_nowait, request_id, forget)
            return
        if forget:
            self.core.forget(request_id)
        action = self.core.abort(request_id)
        if action is not None:
            self.send(action.frame)

    async def aclose(self) -> None:
        if self.core.closed:
            return
        self._apply(self.core.close())
        try:
            await self._stop_reader()
        finally:  # a cancelled close (Ctrl-C) still closes the sockets and the context
            self.release()

    async def _stop_reader(self) -> None:
        """Cancel the reader and wait until it has ended. Only the reader's own cancellation
        is absorbed: one of the task that closes (Ctrl-C under asyncio.run, a caller's
        timeout) goes on to that task's caller, or a Ctrl-C during close would be lost."""
        if self.reader is not None:
            self.reader.cancel()
            await asyncio.wait([self.reader])

    def close_soon(self) -> None:
        """The client was dropped unclosed: close on its loop while that loop is open; once
        it has closed, here (no task of it runs any more, and a context left open would block
        whichever thread garbage-collects it)."""
        loop = self.loop
        if self.core.closed or loop is None:
            return
        if not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: go on below
                loop.call_soon_threadsafe(self._begin_close)
                return
        actions = self.core.close()
        with contextlib.suppress(Exception):  # the aborts are best effort off their loop
            self._apply(actions)
        self.release()

    def _begin_close(self) -> None:
        self._closing = asyncio.ensure_future(self.aclose())  # the loop keeps only weak refs

    def release(self) -> None:
        self.links.close(connected=self.core.welcome is not None)
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

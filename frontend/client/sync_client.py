"""Blocking client of a running pipeline.

A background I/O thread owns the two DEALER sockets (requests to the tokenizer, results from
the detokenizer) and feeds what they and their monitors receive to the ClientCore, which
routes each delta into its request's queue; caller threads only enqueue commands and read
their queues, so one Client serves many threads and many concurrent requests. How a dead,
refusing or unreachable pipeline is noticed is the core's business (see core.py); this
module adds only the optional per-request timeout.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import zmq

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
    EngineDeadError,
    OutputCollector,
    RequestDelta,
    RequestOutput,
)
from frontend.client.transport import Links, check_address, monitor_event
from protocol.sampling_params import SamplingParamsLike

__all__ = ["Client", "ResultStream"]


class Client(ConnectionInfo):
    """Talks to the pipeline whose tokenizer listens at `address`.

    timeout: seconds to wait for each result delta before the request is aborted with
    TimeoutError (None: wait as long as the pipeline is alive). Use it as a context manager or
    call close(); a Client dropped without either is closed when it is garbage-collected.
    """

    def __init__(self, address: str, timeout: float | None = None, *,
                 connect_timeout: float = CONNECT_TIMEOUT_S) -> None:
        check_address(address)
        self.address = address
        self.timeout = timeout
        self._conn = _Connection(address)
        self._core = self._conn.core
        # The I/O thread holds the connection, never the Client: dropping the Client frees it.
        self._finalizer = weakref.finalize(self, self._conn.close)
        self._conn.start()
        if not self._conn.ready.wait(connect_timeout) or self._core.phase is not Phase.READY:
            reason = (self._core.dead
                      or f"no pipeline answered at {address} within {connect_timeout}s")
            self.close()
            raise EngineDeadError(reason)

    # ---------------------------------------------------------- public API

    @property
    def model(self) -> str:
        assert self.welcome is not None
        return self.welcome.model

    @property
    def max_model_len(self) -> int:
        assert self.welcome is not None
        return self.welcome.max_model_len

    def generate(self, prompt: str | None = None, params: SamplingParamsLike | None = None,
                 *, prompt_token_ids: Any = None, messages: Any = None,
                 client_key: str | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> RequestOutput:
        """The whole output. `client_key` names a client of its own within this connection
        (a server relaying many users), for the engine's fair sharing between clients;
        `chat_template_kwargs`, with messages, the chat template's extra variables
        (protocol.template_kwargs)."""
        request_id, q = self._submit(prompt, prompt_token_ids, messages, params, False,
                                     client_key, chat_template_kwargs)
        collector = OutputCollector(request_id)
        done = False
        try:
            while not done:
                delta = self._next(request_id, q)
                collector.add(delta)
                done = delta.finish_reason is not None
        except BaseException:
            self._forget(request_id)
            self.abort(request_id)
            raise
        return collector.output()

    def stream(self, prompt: str | None = None, params: SamplingParamsLike | None = None,
               *, prompt_token_ids: Any = None, messages: Any = None,
               client_key: str | None = None,
               chat_template_kwargs: Mapping[str, Any] | None = None) -> ResultStream:
        """Submit now; iterate for deltas. Closing or dropping the iterator aborts."""
        request_id, q = self._submit(prompt, prompt_token_ids, messages, params, True,
                                     client_key, chat_template_kwargs)
        return ResultStream(self, request_id, q)

    def abort(self, request_id: str) -> None:
        """Ask the engine to stop a request; it then finishes with finish_reason "abort"."""
        with self._conn.lock:
            action = self._core.abort(request_id)
        if action is not None:
            self._conn.command(action.frame)

    def close(self) -> None:
        """Abort whatever is in flight and release the sockets."""
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------- caller side

    def _submit(self, prompt: str | None, prompt_token_ids: Any, messages: Any,
                params: SamplingParamsLike | None, stream: bool,
                client_key: str | None = None,
                chat_template_kwargs: Mapping[str, Any] | None = None
                ) -> tuple[str, queue.SimpleQueue]:
        request_id = uuid.uuid4().hex
        frame = make_request(request_id, prompt, prompt_token_ids, messages, params, stream,
                             client_key, chat_template_kwargs)
        q: queue.SimpleQueue = queue.SimpleQueue()
        while True:
            with self._conn.lock:
                wait = self._core.explaining_s(time.monotonic())
                if not wait:
                    self._core.submit(request_id, q.put)
                    break
            time.sleep(min(wait, 0.05))
        self._conn.command(frame)
        return request_id, q

    def _next(self, request_id: str, q: queue.SimpleQueue) -> RequestDelta:
        try:
            item = q.get(timeout=self.timeout)
        except queue.Empty:
            self._forget(request_id)
            self.abort(request_id)
            raise TimeoutError(f"request {request_id}: no result within {self.timeout}s") \
                from None
        if isinstance(item, BaseException):
            raise item
        return item

    def _forget(self, request_id: str) -> None:
        with self._conn.lock:
            self._core.forget(request_id)


class _Connection:
    """What the I/O thread shares with its Client: the core (under `lock`), the command pipe,
    the zmq context. Sockets live on the I/O thread only; the thread tears everything down
    when it stops, so close() works from any thread (a finalizer may run on the I/O thread)."""

    def __init__(self, address: str) -> None:
        self.core = ClientCore(address)
        self.lock = threading.Lock()
        self._released = False
        self.commands: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        """Frames for the requests link; None stops the I/O thread."""
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self.ctx = zmq.Context()
        self.ready = threading.Event()
        """Set once the handshake is over, whichever way it ended."""
        self._thread = threading.Thread(target=self._io_main, name="nanopipe-client-io",
                                        daemon=True)

    @property
    def closed(self) -> bool:
        return self.core.closed

    def start(self) -> None:
        self._thread.start()

    def command(self, frame: bytes | None) -> None:
        self.commands.put(frame)
        with self.lock:
            if self._released:
                return
            try:
                os.write(self._wake_w, b"\0")
            except (BlockingIOError, OSError):
                pass  # the pipe is full: the I/O thread will drain it

    def close(self) -> None:
        with self.lock:
            if self.core.closed:
                return
            actions = self.core.close()
        for action in actions:
            assert not isinstance(action, Open)
            self.command(action.frame)
        self.command(None)
        if threading.current_thread() is not self._thread and self._thread.ident is not None:
            self._thread.join()
        elif self._thread.ident is None:  # never started
            self._release()

    def _io_main(self) -> None:
        try:
            _IOLoop(self).run()
        except Exception as exc:  # never leave callers waiting on a thread that died
            with self.lock:
                self.core.fail_all(f"client I/O failed: {exc!r}")
        finally:
            self.ready.set()
            self._release()

    def _release(self) -> None:
        """Close the pipe and the context (the thread's sockets are closed already)."""
        with self.lock:
            if self._released:
                return
            self._released = True
            os.close(self.wake_r)
            os.close(self._wake_w)
        self.ctx.term()


class _IOLoop:
    """The I/O thread's state: sockets are made, used and closed on this thread only."""

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn
        self.core = conn.core
        self.poller = zmq.Poller()
        self.links = Links(self.poller)
        self.poller.register(conn.wake_r, zmq.POLLIN)
        self._apply([self.core.start()])

    def run(self) -> None:
        try:
            while self._step():
                pass
        finally:
            self.links.close(connected=self.core.welcome is not None)

    def _step(self) -> bool:
        with self.conn.lock:
            actions = self.core.on_timer(time.monotonic())
            wait = self.core.wait_s(time.monotonic())
        self._apply(actions)
        if not self.core.handshaking:
            self.conn.ready.set()
        for sock, _ in self.poller.poll(None if wait is None else int(wait * 1000) + 1):
            if isinstance(sock, zmq.Socket) and sock.closed:
                continue  # closed by a reconnection earlier in this batch
            if sock == self.conn.wake_r:
                if not self._drain_commands():
                    return False
            elif (monitored := self.links.monitored(sock)) is not None:
                event = monitor_event(sock.recv_multipart())
                with self.conn.lock:
                    self.core.on_monitor(monitored, event, time.monotonic())
            else:
                frames = sock.recv_multipart()
                with self.conn.lock:
                    actions = self.core.on_frame(self.links.link(sock), frames[-1])
                self._apply(actions)
        return True

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Open):
                self.links.open(self.conn.ctx, self.core, action)
            elif isinstance(action, Reset):
                self.links.close(connected=False)
            else:
                self.links.send_request(action.frame)

    def _drain_commands(self) -> bool:
        os.read(self.conn.wake_r, 4096)
        while True:
            try:
                frame = self.conn.commands.get_nowait()
            except queue.Empty:
                return True
            if frame is None:
                return False
            self.links.send_request(frame)


class ResultStream(Iterator[RequestDelta]):
    """Deltas of one streaming request; closing (or dropping) it early aborts the request."""

    def __init__(self, client: Client, request_id: str, q: queue.SimpleQueue) -> None:
        self.client = client
        self.request_id = request_id
        self._q = q
        self._done = False

    def __iter__(self) -> ResultStream:
        return self

    def __next__(self) -> RequestDelta:
        if self._done:
            raise StopIteration
        try:
            delta = self.client._next(self.request_id, self._q)
        except BaseException:
            self.close()  # also on KeyboardInterrupt: the engine must not keep generating
            raise
        if delta.finish_reason is not None:
            self._done = True
        return delta

    def close(self) -> None:
        if not self._done:
            self._done = True
            self.client._forget(self.request_id)
            self.client.abort(self.request_id)

    def __enter__(self) -> ResultStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

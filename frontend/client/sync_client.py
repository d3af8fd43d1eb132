"""Blocking client of a running pipeline.

A background I/O thread owns the two DEALER sockets (requests to the tokenizer, results
from the detokenizer) and routes each ResultDelta into its request's queue; caller
threads only enqueue commands and read their queues, so one Client serves many threads
and many concurrent requests. A dead pipeline is noticed three ways: an EngineDead
message, a dropped connection (socket monitor; ZMTP heartbeats turn a hung or
unreachable peer into a dropped connection), or an optional per-request timeout.

Nothing waits forever on a refusal: an ipc address without a socket file, or one where the
connection is refused (ipc or tcp: zmq reports CONNECT_RETRIED), fails the handshake at once;
a request too big for any pipeline to read is refused before it is sent; and an error the
server could not attribute fails the requests it may belong to (ORPHAN_ERROR).
"""

from __future__ import annotations

import os
import queue
import stat
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from frontend.client.outputs import (
    ClientClosedError,
    EngineDeadError,
    OutputCollector,
    RequestDelta,
    RequestOutput,
    RequestRejected,
)
from protocol import (
    MAX_FRAME_BYTES,
    AbortRequest,
    ChatMessage,
    ClientHello,
    ClientWelcome,
    Decoder,
    EngineDead,
    ErrorKind,
    GenerateRequest,
    ProtocolError,
    RequestError,
    ResultDelta,
    ResultDeltaBatch,
    SamplingParams,
    encode,
)
from protocol.client_messages import as_token_ids
from protocol.outcomes import finish_reason_string

CONNECT_TIMEOUT_S = 60.0
"""How long the handshake may take before the pipeline is declared unreachable."""
DISCONNECT_GRACE_S = 3.0
"""After a lost connection, how long to wait for the pipeline's EngineDead (which names the
process that died and why) before failing requests with a bare "lost the connection"."""
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000
CLOSE_LINGER_MS = 1000
"""How long close() waits for its abort messages to leave."""
REFUSALS_BEFORE_FAILING = 3
"""Refused connection attempts (zmq retries every ~100 ms) before the handshake gives up:
nothing listens there. More than one, so a listener's momentarily full backlog is no error."""
MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED


# ------------------------------------------------------------ shared with AsyncClient


def configure_context(ctx: zmq.Context) -> None:
    """Defaults for every client socket: heartbeats so a silent peer counts as gone."""
    ctx.setsockopt(zmq.LINGER, 0)
    ctx.setsockopt(zmq.SNDHWM, 0)
    ctx.setsockopt(zmq.RCVHWM, 0)
    ctx.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    ctx.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def make_decoder() -> Decoder:
    return Decoder(ClientWelcome, ResultDelta, ResultDeltaBatch, EngineDead)


def make_request(request_id: str, prompt: str | None, prompt_token_ids: Any, messages: Any,
                 params: SamplingParams | None, stream: bool) -> bytes:
    """The encoded request; RequestRejected at once if no pipeline would read a frame so big."""
    if prompt_token_ids is not None:
        prompt_token_ids = as_token_ids(prompt_token_ids)
    if messages is not None:
        messages = [m if isinstance(m, ChatMessage) else ChatMessage(m["role"], m["content"])
                    for m in messages]
    frame = encode(GenerateRequest(
        client_request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
        messages=messages, params=params or SamplingParams(), stream=stream))
    if len(frame) > MAX_FRAME_BYTES:
        sizes = {"prompt": len(prompt or ""), "prompt_token_ids": len(prompt_token_ids or ()),
                 "messages": sum(len(m.content) for m in messages or ())}
        field = max(sizes, key=sizes.__getitem__)
        raise RequestRejected(f"{field}: the request encodes to {len(frame)} bytes, over the "
                              f"{MAX_FRAME_BYTES}-byte limit of one message; shorten the {field}")
    return frame


def check_address(address: str) -> None:
    """Refuse at once an ipc address whose socket file is missing or is no socket: no
    pipeline can answer there (a pipeline binds its socket before it reports ready)."""
    if not address.startswith("ipc://"):
        return
    path = address[len("ipc://"):]
    if path.startswith("@"):  # Linux abstract namespace: no file to look at
        return
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise EngineDeadError(f"no pipeline at {address}: {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise EngineDeadError(f"no pipeline at {address}: {path} is not a socket")


def refused(address: str) -> str:
    return f"no pipeline at {address}: the connection was refused (nothing listens there)"


ORPHAN_ERROR = ("the pipeline refused a request it could not read, without saying which; "
                "every request of this client still waiting for its first answer fails: ")
"""An error delta with no request id (the server could not read the id from the frame) fails
every request that has had no answer yet: the culprit is one of them, and a request that got
an answer was read. Deterministic, and no request waits forever on a refusal; requests failed
this way are also aborted, so the engine does not run them unseen."""


def to_delta(msg: ResultDelta) -> RequestDelta:
    top = None
    if msg.top_token_ids is not None and msg.top_logprobs is not None:
        top = [list(zip(ids, lps, strict=True))
               for ids, lps in zip(msg.top_token_ids, msg.top_logprobs, strict=True)]
    return RequestDelta(request_id=msg.client_request_id, text=msg.text,
                        token_ids=msg.token_ids,
                        finish_reason=finish_reason_string(msg.finish_reason),
                        prompt_tokens=msg.prompt_tokens,
                        completion_tokens=msg.completion_tokens, logprobs=msg.logprobs,
                        top_logprobs=top)


def error_for(error: RequestError) -> Exception:
    if error.kind is ErrorKind.ENGINE_DEAD:
        return EngineDeadError(error.message)
    return RequestRejected(error.message, error.field)


def monitor_event(monitor_frames: list[bytes]) -> int:
    return parse_monitor_message(monitor_frames)["event"]


class HandshakeWatch:
    """Counts refused connection attempts of one socket until it first connects."""

    def __init__(self) -> None:
        self.connected = False
        self.refusals = 0

    def gave_up(self, event: int) -> bool:
        """True when this event shows nothing listens at the address."""
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
        elif event == zmq.EVENT_CONNECT_RETRIED and not self.connected:
            self.refusals += 1
        return self.refusals >= REFUSALS_BEFORE_FAILING


class ConnectionInfo:
    """What Client and AsyncClient report about their connection (held in `_conn`)."""

    _conn: Any

    @property
    def client_id(self) -> str:
        return self._conn.client_id

    @property
    def welcome(self) -> ClientWelcome | None:
        return self._conn.welcome

    @property
    def dead(self) -> bool:
        """True once the pipeline is known to be gone (requests then raise EngineDeadError)."""
        return self._conn.dead is not None


# ------------------------------------------------------------ Client


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
        # The I/O thread holds the connection, never the Client: dropping the Client frees it.
        self._finalizer = weakref.finalize(self, self._conn.close)
        self._conn.start()
        if not self._conn.ready.wait(connect_timeout) or self._conn.welcome is None:
            reason = (self._conn.dead
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

    def generate(self, prompt: str | None = None, *, prompt_token_ids: Any = None,
                 messages: Any = None, params: SamplingParams | None = None) -> RequestOutput:
        request_id, q = self._submit(prompt, prompt_token_ids, messages, params, stream=False)
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

    def stream(self, prompt: str | None = None, *, prompt_token_ids: Any = None,
               messages: Any = None, params: SamplingParams | None = None) -> ResultStream:
        """Submit now; iterate for deltas. Closing or dropping the iterator aborts."""
        request_id, q = self._submit(prompt, prompt_token_ids, messages, params, stream=True)
        return ResultStream(self, request_id, q)

    def abort(self, request_id: str) -> None:
        """Ask the engine to stop a request; it then finishes with finish_reason "abort"."""
        if not self._conn.closed:
            self._conn.command(encode(AbortRequest(request_id)))

    def close(self) -> None:
        """Abort whatever is in flight and release the sockets."""
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------- caller side

    def _submit(self, prompt: str | None, prompt_token_ids: Any, messages: Any,
                params: SamplingParams | None, stream: bool) -> tuple[str, queue.SimpleQueue]:
        request_id = uuid.uuid4().hex
        frame = make_request(request_id, prompt, prompt_token_ids, messages, params, stream)
        q: queue.SimpleQueue = queue.SimpleQueue()
        conn = self._conn
        with conn.lock:
            if conn.closed:
                raise ClientClosedError("the client is closed")
            if conn.dead is not None:
                raise EngineDeadError(conn.dead)
            conn.queues[request_id] = q
            conn.unanswered.add(request_id)
        conn.command(frame)
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
            self._conn.queues.pop(request_id, None)
            self._conn.unanswered.discard(request_id)


class _Connection:
    """What the I/O thread shares with its Client: request queues, the command pipe, the
    zmq context. Sockets live on the I/O thread only; the thread tears everything down when
    it stops, so close() works from any thread (a finalizer may run on the I/O thread)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.client_id = uuid.uuid4().hex
        self.welcome: ClientWelcome | None = None
        self.lock = threading.Lock()
        self.queues: dict[str, queue.SimpleQueue] = {}
        self.unanswered: set[str] = set()
        """Requests sent that have had no delta yet (see ORPHAN_ERROR)."""
        self.dead: str | None = None
        self.closed = False
        self._released = False
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self.ctx = zmq.Context()
        configure_context(self.ctx)
        self.ready = threading.Event()
        self._thread = threading.Thread(target=self._io_main, name="nanopipe-client-io",
                                        daemon=True)

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
            if self.closed:
                return
            self.closed = True
            pending = list(self.queues.items())
            self.queues.clear()
        for request_id, q in pending:
            self.command(encode(AbortRequest(request_id)))
            q.put(ClientClosedError(f"request {request_id}: the client was closed"))
        self.command(None)
        if threading.current_thread() is not self._thread and self._thread.ident is not None:
            self._thread.join()
        elif self._thread.ident is None:  # never started
            self._release()

    def _io_main(self) -> None:
        try:
            _ClientIO(self).run()
        except Exception as exc:  # never leave callers waiting on a thread that died
            self.fail_all(f"client I/O failed: {exc!r}")
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

    def route(self, msg: Any) -> None:
        if isinstance(msg, EngineDead):
            self.fail_all(msg.reason)
            return
        if isinstance(msg, ResultDeltaBatch):
            for delta in msg.deltas:
                self.route(delta)
            return
        if msg.error is not None and not msg.client_request_id:
            self.fail_unanswered(msg.error.message)
            return
        with self.lock:
            q = self.queues.get(msg.client_request_id)
            self.unanswered.discard(msg.client_request_id)
            if q is not None and msg.finish_reason is not None:
                del self.queues[msg.client_request_id]
        if q is None:
            return  # aborted or timed out already
        if msg.error is not None:
            q.put(error_for(msg.error))
        else:
            q.put(to_delta(msg))

    def fail_all(self, reason: str) -> None:
        with self.lock:
            if self.dead is None:
                self.dead = reason
            pending = list(self.queues.values())
            self.queues.clear()
            self.unanswered.clear()
        for q in pending:
            q.put(EngineDeadError(reason))

    def fail_unanswered(self, error: str) -> None:
        with self.lock:
            failed = [(rid, self.queues.pop(rid)) for rid in sorted(self.unanswered)
                      if rid in self.queues]
            self.unanswered.clear()
        for request_id, q in failed:
            self.command(encode(AbortRequest(request_id)))
            q.put(RequestRejected(ORPHAN_ERROR + error))


class _ClientIO:
    """The I/O thread's state: sockets are made, used and closed on this thread only."""

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn
        self.decoder = make_decoder()
        self.poller = zmq.Poller()
        self.monitors: dict[zmq.Socket, tuple[str, HandshakeWatch]] = {}
        self.sockets: list[zmq.Socket] = []
        self.requests = self._dealer(conn.address)
        self.results: zmq.Socket | None = None
        self.lost_at: float | None = None
        """When a connection dropped, while waiting for the EngineDead that explains it."""
        self.poller.register(conn.wake_r, zmq.POLLIN)

    def _dealer(self, address: str) -> zmq.Socket:
        sock = self.conn.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.conn.client_id.encode())
        monitor = sock.get_monitor_socket(MONITOR_EVENTS)
        sock.connect(address)
        sock.send(encode(ClientHello(self.conn.client_id)))
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)
        self.sockets.append(sock)
        self.monitors[monitor] = (address, HandshakeWatch())
        return sock

    def run(self) -> None:
        try:
            while self._step():
                pass
        finally:
            self._close()

    def _step(self) -> bool:
        timeout_ms = None
        if self.lost_at is not None:
            left = self.lost_at + DISCONNECT_GRACE_S - time.monotonic()
            if left <= 0:
                self.lost_at = None
                self.conn.fail_all(f"lost the connection to the pipeline at "
                                   f"{self.conn.address}")
            else:
                timeout_ms = int(left * 1000) + 1
        for sock, _ in self.poller.poll(timeout_ms):
            if sock == self.conn.wake_r:
                if not self._drain_commands():
                    return False
            elif sock in self.monitors:
                self._on_monitor(sock)
            else:
                self._on_frame(sock)
        return True

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        event = monitor_event(monitor.recv_multipart())
        address, watch = self.monitors[monitor]
        if event == zmq.EVENT_DISCONNECTED:
            # The surviving processes relay the launcher's EngineDead with the reason;
            # give it a moment to arrive so every client learns the same, deterministic one.
            if self.lost_at is None and self.conn.dead is None:
                self.lost_at = time.monotonic()
        elif watch.gave_up(event) and not self.conn.ready.is_set():
            self.conn.fail_all(refused(address))
            self.conn.ready.set()

    def _drain_commands(self) -> bool:
        os.read(self.conn.wake_r, 4096)
        while True:
            try:
                frame = self.conn.commands.get_nowait()
            except queue.Empty:
                return True
            if frame is None:
                return False
            try:
                self.requests.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                pass

    def _on_frame(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart()
        try:
            msg = self.decoder.decode(frames[-1])
        except ProtocolError:
            return  # not ours to crash on; the engine never sends these
        if isinstance(msg, ClientWelcome):
            self._on_welcome(sock, msg)
        elif isinstance(msg, EngineDead) and not self.conn.ready.is_set():
            self.conn.fail_all(msg.reason)
            self.conn.ready.set()
        else:
            self.conn.route(msg)

    def _on_welcome(self, sock: zmq.Socket, msg: ClientWelcome) -> None:
        if sock is self.requests and self.results is None:
            self.results = self._dealer(msg.results_address)
            self.welcome = msg
        elif sock is self.results and not self.conn.ready.is_set():
            self.conn.welcome = self.welcome
            self.conn.ready.set()

    def _close(self) -> None:
        for sock in self.sockets:
            sock.disable_monitor()
        for monitor in self.monitors:
            monitor.close(linger=0)
        # Once connected, the tokenizer socket lingers briefly so close()'s aborts get out.
        self.requests.close(linger=CLOSE_LINGER_MS if self.conn.welcome else 0)
        if self.results is not None:
            self.results.close(linger=0)


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

"""The client's half of the connection protocol, with no I/O in it.

`Client` (an I/O thread) and `AsyncClient` (a reader task) both drive one `ClientCore`: they
open the sockets it asks for, feed it every frame and socket-monitor event that arrives, and
carry out what it returns. The core alone decides the two-step handshake, which request a
delta belongs to, and which requests fail, and why, when the pipeline refuses, dies or
drops the connection. It is not thread-safe: the blocking client calls it under one lock.

A dropped connection without an EngineDead (a peer stalled past the heartbeat timeout, then
resumed) is not death: the requests in flight fail with ConnectionLostError, since their
results may be lost, and the core reconnects with a fresh handshake (under a new client id,
so nothing of the old routes is reused); new requests are served again once it is done.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from frontend.client.frames import outcome
from frontend.client.outputs import (
    ClientClosedError,
    ConnectionLostError,
    EngineDeadError,
    RequestDelta,
    RequestRejected,
)
from frontend.client.unreachable import HANDSHAKE_FAILED, HandshakeWatch, not_zmq, refused
from protocol import (
    AbortRequest,
    ClientHello,
    ClientWelcome,
    Decoder,
    EngineDead,
    ProtocolError,
    ResultDelta,
    ResultDeltaBatch,
    encode,
)

CONNECT_TIMEOUT_S = 60.0
"""How long the handshake may take before the pipeline is declared unreachable."""
DISCONNECT_GRACE_S = 3.0
"""After a lost connection, how long to wait for the pipeline's EngineDead (which names the
process that died and why) before failing requests with a bare "lost the connection"."""
RECONNECT_RETRY_S = 30.0
"""A reconnecting handshake not done in this long starts over on new sockets. A peer that is
still stalled holds it (its socket accepts, it does not answer), one that came back answers
within milliseconds; zmq itself gives up a silent handshake after 30 s."""
ORPHAN_ERROR = ("the pipeline refused a request it could not read, without saying which; "
                "every request of this client still waiting for its first answer fails: ")
"""An error delta with no request id (the server could not read the id from the frame) fails
every request that has had no answer yet: the culprit is one of them, and a request that got
an answer was read. Deterministic, and no request waits forever on a refusal; requests failed
this way are also aborted, so the engine does not run them unseen."""


class Link(enum.Enum):
    REQUESTS = "requests"
    """DEALER to the tokenizer: requests and aborts out; its welcome and refusals back."""
    RESULTS = "results"
    """DEALER to the detokenizer: results back."""


class Phase(enum.Enum):
    CONNECTING = enum.auto()
    """Hello sent to the tokenizer; waiting for its welcome (which names the results link)."""
    JOINING = enum.auto()
    """Hello sent on the results link; waiting for the detokenizer's welcome."""
    READY = enum.auto()
    FAILED = enum.auto()
    """The handshake ended without a pipeline: `ClientCore.dead` says why."""


@dataclass(frozen=True, slots=True)
class Open:
    """Connect a DEALER (identity: the client id) for `link` to `address`, then send `hello`."""

    link: Link
    address: str
    hello: bytes


@dataclass(frozen=True, slots=True)
class Send:
    """Send `frame` on the requests link."""

    frame: bytes


@dataclass(frozen=True, slots=True)
class Reset:
    """Close both links and their monitors (an Open follows: the reconnection)."""


Action = Open | Send | Reset
Sink = Callable[[RequestDelta | Exception], None]
"""Where a request's deltas go (a queue's put); an exception is its last item."""


class ClientCore:
    """The state of one client's connection: handshake, in-flight requests, death."""

    def __init__(self, address: str, client_id: str | None = None) -> None:
        self.address = address
        self.client_id = client_id or uuid.uuid4().hex
        self.phase = Phase.CONNECTING
        self.welcome: ClientWelcome | None = None
        """The tokenizer's welcome, once both links are up."""
        self.dead: str | None = None
        """Why the pipeline is gone; every request then fails with EngineDeadError."""
        self.closed = False
        self.lost_at: float | None = None
        """When a connection dropped, while waiting for the EngineDead that explains it."""
        self._decoder = Decoder(ClientWelcome, ResultDelta, ResultDeltaBatch, EngineDead)
        self._sinks: dict[str, Sink] = {}
        self._unanswered: set[str] = set()
        """Requests sent that have had no delta yet (see ORPHAN_ERROR)."""
        self._addresses = {Link.REQUESTS: address}
        self._watches = {Link.REQUESTS: HandshakeWatch(), Link.RESULTS: HandshakeWatch()}
        self._first_welcome: ClientWelcome | None = None
        self.lost: str | None = None
        """Why requests fail while the core reconnects after a dropped connection."""
        self._retry_at: float | None = None
        """When a reconnecting handshake starts over."""
        self._stranded = False
        """The requests in flight when the connection dropped are still to be failed."""

    @property
    def handshaking(self) -> bool:
        return self.phase in (Phase.CONNECTING, Phase.JOINING)

    @property
    def first_connection(self) -> bool:
        """No pipeline has welcomed this client yet: a silent peer is no pipeline."""
        return self.welcome is None

    def start(self) -> Open:
        """The first action: open the requests link."""
        return Open(Link.REQUESTS, self.address, encode(ClientHello(self.client_id)))

    # ---------------------------------------------------------- what arrives

    def on_frame(self, link: Link, frame: bytes) -> list[Action]:
        try:
            msg = self._decoder.decode(frame)
        except ProtocolError:
            return []  # not ours to crash on; the engine never sends these
        if isinstance(msg, ClientWelcome):
            return self._on_welcome(link, msg)
        if isinstance(msg, EngineDead):
            self.fail_all(msg.reason)
            return []
        deltas = msg.deltas if isinstance(msg, ResultDeltaBatch) else [msg]
        actions: list[Action] = []
        for delta in deltas:
            actions += self._route(delta)
        return actions

    def on_monitor(self, link: Link, event: int, now: float) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            # The surviving processes relay the launcher's EngineDead with the reason; give it
            # a moment to arrive so every client learns the same, deterministic one.
            # New requests are refused from now on: until it is reconnected, one sent on the
            # old link could be stranded.
            if self.lost_at is None and self.dead is None:
                self.lost_at = now
                if self.lost is None and self.welcome is not None:
                    self.lost = (f"lost the connection to the pipeline at {self.address} (no "
                                 "answer within the heartbeat timeout); reconnecting: requests "
                                 "in flight fail, new ones are refused until it is back")
                    self._stranded = True
        elif event & HANDSHAKE_FAILED and self.handshaking and self.first_connection:
            self.fail_all(not_zmq(self._addresses[link]))
        elif self._watches[link].gave_up(event) and self.handshaking:
            lost = "" if self.lost is None else f"lost the connection to {self.address}; "
            self.fail_all(lost + refused(self._addresses[link]))
        elif event == zmq.EVENT_CONNECTED and self.lost is not None and self.handshaking:
            self._fail_stranded()  # something listens: a stalled peer, not a stopped one

    def _fail_stranded(self) -> None:
        if self._stranded:
            self._stranded = False
            sinks = list(self._sinks.values())
            self._sinks.clear()
            self._unanswered.clear()
            for sink in sinks:
                sink(ConnectionLostError(self.lost or "lost the connection"))

    def wait_s(self, now: float) -> float | None:
        """How long the driver may wait for I/O before calling on_timer (None: forever)."""
        due = [t for t in (self._retry_at,
                           None if self.lost_at is None else self.lost_at + DISCONNECT_GRACE_S)
               if t is not None]
        return max(0.0, min(due) - now) if due else None

    def on_timer(self, now: float) -> list[Action]:
        if self.lost_at is not None and now >= self.lost_at + DISCONNECT_GRACE_S:
            self.lost_at = None
            if self.welcome is None:  # never connected: nothing to come back to
                self.fail_all(f"lost the connection to the pipeline at {self.address}")
                return []
            return self._reconnect(now)
        if self._retry_at is not None and now >= self._retry_at:
            self._fail_stranded()  # the pipeline neither answers nor refuses
            return self._reconnect(now)
        return []

    def _reconnect(self, now: float) -> list[Action]:
        """Start a fresh handshake. What was in flight is stranded (its results may be lost):
        it fails with EngineDeadError if nothing listens there any more, else once something
        accepts the new connection (a stalled peer's socket does) with ConnectionLostError."""
        if self.closed or self.dead is not None:
            return []
        self.client_id = uuid.uuid4().hex
        self.phase = Phase.CONNECTING
        self._watches = {Link.REQUESTS: HandshakeWatch(), Link.RESULTS: HandshakeWatch()}
        self._retry_at = now + RECONNECT_RETRY_S
        return [Reset(), self.start()]

    def _on_welcome(self, link: Link, msg: ClientWelcome) -> list[Action]:
        if link is Link.REQUESTS and self.phase is Phase.CONNECTING:
            self._first_welcome = msg
            self._addresses[Link.RESULTS] = msg.results_address
            self.phase = Phase.JOINING
            return [Open(Link.RESULTS, msg.results_address, encode(ClientHello(self.client_id)))]
        if link is Link.RESULTS and self.phase is Phase.JOINING:
            self.welcome = self._first_welcome
            self.phase = Phase.READY
            self._fail_stranded()
            self.lost = self._retry_at = None
        return []

    def _route(self, msg: ResultDelta) -> list[Action]:
        request_id = msg.client_request_id
        if msg.error is not None and not request_id:
            return self._fail_unanswered(msg.error.message)
        self._unanswered.discard(request_id)
        sink = self._sinks.get(request_id)
        if sink is None:
            return []  # aborted or timed out already
        if msg.finish_reason is not None:
            del self._sinks[request_id]
        sink(outcome(msg))
        return []

    def _fail_unanswered(self, error: str) -> list[Action]:
        actions: list[Action] = []
        for request_id in sorted(self._unanswered):
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                actions.append(Send(encode(AbortRequest(request_id))))
                sink(RequestRejected(ORPHAN_ERROR + error))
        self._unanswered.clear()
        return actions

    # ---------------------------------------------------------- what the caller does

    def explaining_s(self, now: float) -> float:
        """How long a new request should wait before `submit`: a dropped connection whose
        EngineDead may still come (DISCONNECT_GRACE_S) decides between "the engine died,
        because ..." and "lost the connection"; 0 when nothing is pending."""
        if self.lost_at is None or self.dead is not None:
            return 0.0
        return max(0.0, self.lost_at + DISCONNECT_GRACE_S - now)

    def submit(self, request_id: str, sink: Sink) -> None:
        """Track a request about to be sent; refuses once the client is closed or dead."""
        if self.closed:
            raise ClientClosedError("the client is closed")
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self.lost is not None:
            raise ConnectionLostError(self.lost)
        self._sinks[request_id] = sink
        self._unanswered.add(request_id)

    def forget(self, request_id: str) -> None:
        """The caller stopped waiting for the request: its later deltas are dropped."""
        self._sinks.pop(request_id, None)
        self._unanswered.discard(request_id)

    def abort(self, request_id: str) -> Send | None:
        """The frame that stops a request at the engine; None when nothing would read it."""
        if self.closed or self.dead is not None or self.lost is not None:
            return None
        return Send(encode(AbortRequest(request_id)))

    def fail_all(self, reason: str) -> None:
        """The pipeline is gone: every request in flight fails, and so will later ones."""
        if self.dead is None:
            self.dead = reason
        self.lost = self._retry_at = None
        self._stranded = False
        if self.handshaking:
            self.phase = Phase.FAILED
        sinks = list(self._sinks.values())
        self._sinks.clear()
        self._unanswered.clear()
        for sink in sinks:
            sink(EngineDeadError(reason))

    def close(self) -> list[Action]:
        """Fail what is in flight with ClientClosedError; returns the aborts to send."""
        if self.closed:
            return []
        self.closed = True
        pending = list(self._sinks.items())
        self._sinks.clear()
        self._unanswered.clear()
        actions: list[Action] = []
        for request_id, sink in pending:
            actions.append(Send(encode(AbortRequest(request_id))))
            sink(ClientClosedError(f"request {request_id}: the client was closed"))
        return actions

    @property
    def in_flight(self) -> int:
        return len(self._sinks)

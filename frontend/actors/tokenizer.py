"""The tokenizer actor: the pipeline's front door.

It greets clients, validates and tokenizes their requests, assigns request ids, and tells
the detokenizer about a request before the scheduler hears of it (so results always find
their route). Bad input is answered on the spot and never reaches the rest of the pipeline.

No client can stall another: this module is the I/O loop, which only measures and
classifies request frames; a prompt too large to fit max_model_len is refused by its size
(prompt_limits.py), and the rest is decoded, validated and tokenized by a small pool of
threads (tokenize_pool.py running request_prep.py). An abort that arrives while its request
is still being tokenized is honoured (request_book.py): the request never reaches the
scheduler and ends with ABORT.
Every error a client can cause carries its request id whenever the frame's first bytes hold
one; a REQ peer gets its error inside the envelope it can read.
"""

from __future__ import annotations

import copy
import errno
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from frontend.actors.model_tokenizer import eos_token_ids, load_tokenizer, model_vocab_size
from frontend.actors.prompt_limits import PromptLimits
from frontend.actors.replies import abort_delta, error_delta, malformed
from frontend.actors.request_book import RequestBook
from frontend.actors.request_prep import Prepared, add_request, detok_request_info, prepare
from frontend.actors.request_validation import (
    RequestValidator,
    peek_request_id,
    salvage_request_id,
)
from frontend.actors.tokenize_pool import LARGE_JOB_BYTES, TokenizeJob, TokenizePool
from frontend.router.config import RouterConfig
from frontend.router.dispatch import ReplicaDispatch
from protocol import (
    AbortRequest,
    AbortRequests,
    ClientHello,
    ClientWelcome,
    Decoder,
    Endpoints,
    EngineDead,
    ErrorKind,
    FinishReason,
    GenerateRequest,
    ProtocolError,
    RequestError,
    Shutdown,
    encode,
)
from protocol.actor_start import from_plain, read_start
from protocol.control import ReplicaDown
from protocol.outcomes import invalid
from protocol.process_runtime import (
    POLL_MS,
    ProcessRuntime,
    QuietStartupError,
    Started,
    actor_process,
    start_and_serve,
)
from protocol.sockets import RouterSocket
from protocol.startup_phases import PhaseClock

log = logging.getLogger("nanopipe.tokenizer")

TOKENIZE_THREADS = 2
"""Tokenizing threads: long prompts use all but one, so a short request never waits."""
CLIENT_PENDING_BYTES = 256 << 20
"""Request bytes one client may have waiting to be tokenized; more are refused as busy."""


@dataclass(frozen=True)
class TokenizerConfig:
    model: str
    """Model directory (holds the tokenizer files and config.json)."""
    max_model_len: int
    model_name: str | None = None
    """Name reported to clients; defaults to the directory name."""
    vocab_size: int | None = None
    """Valid token ids are [0, vocab_size); None reads it from config.json / the tokenizer."""
    router: RouterConfig | None = None
    """The data-parallel replicas requests are placed on; None: the one scheduler of
    `endpoints`."""

    @property
    def served_name(self) -> str:
        return self.model_name or Path(self.model).name


def _client_socket(rt: ProcessRuntime, address: str) -> RouterSocket:
    """The public socket clients connect to. Its tcp port is checked free before start-up,
    but another process may take it while the workers load: that is one line, not a
    traceback (QuietStartupError: the launcher prints it)."""
    try:
        return RouterSocket(rt.ctx, address, accepts=(ClientHello, GenerateRequest,
                                                      AbortRequest))
    except zmq.ZMQError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        where = address.removeprefix("tcp://").rpartition(":")
        raise QuietStartupError(f"the client port {where[2]} on {where[0]} is already in use "
                                "(another process took it during start-up)") from None


class TokenizerActor:
    """The I/O loop: reads client frames, hands GenerateRequests to a pool of tokenizing
    threads, and forwards what they prepare. Only cheap work happens on this thread: small
    control frames are decoded here; request frames are only measured and classified by
    their first bytes (`peek_head`)."""

    def __init__(self, config: TokenizerConfig, endpoints: Endpoints, rt: ProcessRuntime,
                 tokenizer: Any, *, threads: int = TOKENIZE_THREADS) -> None:
        self.config = config
        self.endpoints = endpoints
        self.rt = rt
        vocab = config.vocab_size or model_vocab_size(config.model, tokenizer)
        self.validator = RequestValidator(tokenizer, vocab)
        self.limits = PromptLimits.for_tokenizer(tokenizer, config.max_model_len)
        self.client_budget_bytes = max(CLIENT_PENDING_BYTES, 2 * self.limits.max_frame_bytes)
        self.request_decoder = Decoder(GenerateRequest, max_bytes=self.limits.max_frame_bytes)
        self.eos_ids = eos_token_ids(config.model, tokenizer)
        self.router = rt.adopt(_client_socket(rt, endpoints.tokenizer))
        # With several replicas the detokenizer's aborts (stop strings, lost clients) come
        # here too, as only the router knows which replica holds a request.
        self.ctl = rt.socket(zmq.PULL, endpoints.tokenizer_ctl, bind=True,
                             accepts=(EngineDead, Shutdown, ReplicaDown, AbortRequests),
                             security=endpoints.keys)
        router = config.router or RouterConfig(
            (endpoints.scheduler_in,), (endpoints.deltas_pub,), block_size=1, kv_blocks=(1,))
        self.dispatch = ReplicaDispatch(rt, router, endpoints.keys)
        self.to_detok = rt.socket(zmq.PUSH, endpoints.detok_in, bind=False,
                                  security=endpoints.keys)
        self.clients: dict[bytes, str] = {}  # peer routing id -> client_id
        self.connections: dict[bytes, int] = {}  # peer -> its number: its fair-share key
        self.book = RequestBook()
        self.dead_reason: str | None = None
        # Each thread tokenizes with its own copy: a fast tokenizer is not safe to share.
        validators = [self.validator] + [
            RequestValidator(copy.deepcopy(tokenizer), vocab)
            for _ in range(threads - 1)]
        self.pool = TokenizePool([functools.partial(
            prepare, self.request_decoder, self.limits, v) for v in validators])

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router.socket, zmq.POLLIN)
        poller.register(self.ctl.socket, zmq.POLLIN)
        poller.register(self.pool.fileno(), zmq.POLLIN)
        for sock in self.dispatch.poll_sockets:
            poller.register(sock, zmq.POLLIN)
        try:
            while self.rt.stop_reason is None:
                ready = dict(poller.poll(POLL_MS))
                if self.ctl.socket in ready and not self._on_control():
                    return
                for sock in self.dispatch.poll_sockets:
                    if sock in ready:
                        self.dispatch.on_readable(sock)
                if self.pool.fileno() in ready:
                    for job in self.pool.drain():
                        self._on_prepared(job)
                if self.router.socket in ready:
                    # Drain a bounded batch so control messages are never starved.
                    for _ in range(256):
                        if not self.router.poll(0):
                            break
                        self._on_client_frame()
        finally:
            self.pool.close()

    def _on_control(self) -> bool:
        try:
            msg = self.ctl.recv()
        except ProtocolError as exc:
            log.warning("tokenizer: bad control frame: %s", exc)
            return True
        if isinstance(msg, Shutdown):
            return False
        if isinstance(msg, AbortRequests):
            self.dispatch.abort(msg)
            return True
        if isinstance(msg, ReplicaDown):
            deltas = self.dispatch.replica_down(msg.replica, msg.reason)
            if deltas is not None:
                self.to_detok.send(deltas)
            return True
        self.dead_reason = msg.reason
        for peer in list(self.clients):
            self.router.send_to(peer, EngineDead(msg.reason))
        return True

    # ---------------------------------------------------------------- client frames

    def _on_client_frame(self) -> None:
        frames = self.router.socket.recv_multipart(copy=False)
        peer, body = frames[0].bytes, frames[1:]
        if len(body) > 1 and not any(len(f) for f in body[:-1]):
            self._refuse_envelope(peer, body)
            return
        if len(body) != 1:
            self.router.send_to(peer, error_delta("", malformed("expected one frame")))
            return
        frame = body[0].buffer
        request_id = peek_request_id(frame)
        if request_id is not None:
            self._on_generate_frame(peer, request_id, frame)
            return
        if len(frame) > LARGE_JOB_BYTES:  # not worth decoding here: no control frame is large
            self.router.send_to(peer, error_delta("", malformed(
                f"a frame of {len(frame)} bytes that is not a request")))
            return
        try:
            msg = self.router.decode(frame)
        except ProtocolError as exc:
            self.router.send_to(peer, error_delta("", malformed(exc)))
            return
        if isinstance(msg, ClientHello):
            self._on_hello(peer, msg)
        elif isinstance(msg, AbortRequest):
            self._on_abort(peer, msg)
        else:  # a request whose id is too long to read from the head: the pool says so
            self._on_generate_frame(peer, "", frame)

    def _refuse_envelope(self, peer: bytes, body: list[zmq.Frame]) -> None:
        """A REQ socket (or a proxy) puts empty delimiter frames before the message; answer
        with the same envelope, which is the only reply such a peer can read."""
        envelope = [f.bytes for f in body[:-1]]
        request_id = salvage_request_id(body[-1].buffer) or ""
        reply = error_delta(request_id, invalid(
            "this socket serves DEALER peers (nanopipe's Client and AsyncClient); a REQ "
            "socket cannot receive results: connect with zmq.DEALER and send one frame"))
        try:
            self.router.socket.send_multipart([peer, *envelope, encode(reply)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise

    def _on_hello(self, peer: bytes, msg: ClientHello) -> None:
        if self.dead_reason is not None:
            self.router.send_to(peer, EngineDead(self.dead_reason))
            return
        self.clients[peer] = msg.client_id
        self.connections.setdefault(peer, len(self.connections))
        self.router.send_to(peer, ClientWelcome(
            results_address=self.endpoints.results, model=self.config.served_name,
            max_model_len=self.config.max_model_len, deltas_address=self.endpoints.deltas_pub))

    def _on_generate_frame(self, peer: bytes, request_id: str, frame: memoryview) -> None:
        """Measure, then queue for the pool: nothing here grows with the prompt."""
        arrival = time.time()
        if self.dead_reason is not None:
            self.router.send_to(peer, EngineDead(self.dead_reason))
            return
        if peer not in self.clients:
            self.router.send_to(peer, error_delta(
                request_id, invalid("send ClientHello before any request")))
            return
        size = len(frame)
        if size > self.limits.max_frame_bytes:
            self.router.send_to(peer, error_delta(
                request_id, invalid(self.limits.frame_error(size), "prompt")))
            return
        pending = self.pool.pending_bytes(peer)
        if pending + size > self.client_budget_bytes:
            self.router.send_to(peer, error_delta(request_id, RequestError(
                ErrorKind.BUSY,
                f"busy: this client already has {pending} bytes of requests waiting to be "
                f"tokenized (at most {self.client_budget_bytes}); retry when some finish")))
            return
        job = TokenizeJob(peer=peer, client_request_id=request_id, frame=frame, size=size,
                          arrival_time=arrival)
        self.book.preparing(job)
        self.pool.submit(job)

    def _on_prepared(self, job: TokenizeJob) -> None:
        self.book.prepared(job)
        result = job.result
        if job.cancelled:
            self.router.send_to(job.peer, abort_delta(job.client_request_id))
        elif self.dead_reason is not None:
            self.router.send_to(job.peer, EngineDead(self.dead_reason))
        elif isinstance(result, Prepared):
            self._forward(job.peer, result.request, result.token_ids, job.arrival_time)
        else:
            error = result if isinstance(result, RequestError) else RequestError(
                ErrorKind.REQUEST_FAILED, f"internal error: {result!r}")
            self.router.send_to(job.peer, error_delta(job.client_request_id, error))

    def _forward(self, peer: bytes, req: GenerateRequest, ids: list[int],
                 arrival_time: float) -> None:
        refusal = self.dispatch.refusal()  # all down: the launcher's EngineDead is on its way
        if refusal is not None:
            self.router.send_to(peer, error_delta(req.client_request_id, RequestError(
                ErrorKind.ENGINE_DEAD, refusal)))
            return
        request_id = self.book.assign(peer, req.client_request_id)
        # The detokenizer must know the route before any token of this request can exist.
        self.to_detok.send(detok_request_info(request_id, self.clients[peer], req, ids))
        self.dispatch.add(add_request(request_id, req, ids, self.eos_ids, arrival_time,
                                      self.connections[peer]))

    def _on_abort(self, peer: bytes, msg: AbortRequest) -> None:
        job = self.book.take_preparing(peer, msg.client_request_id)
        if job is not None:
            # Still tokenizing: it never reaches the scheduler. A queued job is dropped now;
            # a running one is answered when its thread finishes.
            if self.pool.cancel(job):
                self.router.send_to(peer, abort_delta(msg.client_request_id))
            return
        request_id = self.book.take_request_id(peer, msg.client_request_id)
        if request_id is not None:
            self.dispatch.abort(AbortRequests(request_ids=[request_id],
                                              reason=FinishReason.ABORT))


def run_tokenizer(config: TokenizerConfig, endpoints: Endpoints) -> None:
    """Process entry point: serve until Shutdown, SIGTERM/SIGINT or the parent's death."""
    with actor_process("tokenizer", endpoints) as rt:
        def start() -> Started:
            clock = PhaseClock()
            tokenizer = load_tokenizer(config.model)
            clock.mark("tokenizer")
            actor = TokenizerActor(config, endpoints, rt, tokenizer)
            return Started(actor.serve, f"model={config.served_name} "
                                        f"vocab_size={actor.validator.vocab_size}",
                           phases=clock.phases)

        start_and_serve(rt, endpoints, start)


def main() -> None:
    """`python -m frontend.actors.tokenizer`, started by the launcher (spec on stdin)."""
    start = read_start()
    run_tokenizer(from_plain(TokenizerConfig, start.config["tokenizer"]),
                  from_plain(Endpoints, start.config["endpoints"]))


if __name__ == "__main__":
    main()

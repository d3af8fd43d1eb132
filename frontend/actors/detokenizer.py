"""The detokenizer actor: turns each step's TokenDeltas into text and routes it to clients.

It owns the decoding state of every running request. Requests are announced by the
tokenizer (DetokRequestInfo) before the scheduler sees them, but on another pipe: deltas that
overtake their announcement wait for it (as do a decode replica's: handoff_order).

The final delta of each request carries its RequestMetrics, which the scheduler sends with
the request's finish. A request this actor ends itself (a stop string) is finished in the
scheduler only after it hears so: its final delta waits here for that finish (one round trip).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from frontend.actors.finishes import ended_at_stop, text_token_ids
from frontend.actors.handoff_order import HandoffOrder
from frontend.actors.incremental_detok import DecodeFn, IncrementalDetokenizer, make_decode_fn
from frontend.actors.replies import engine_dead_error, error_delta, malformed
from frontend.actors.token_bytes import TokenBytes
from frontend.actors.tokenizer_cache import load_decoder
from frontend.actors.top_alternatives import Top, joined
from protocol import (
    AbortRequests,
    ClientHello,
    ClientWelcome,
    DetokRequestInfo,
    Endpoints,
    EngineDead,
    FinishReason,
    ProtocolError,
    RequestError,
    RequestMetrics,
    ResultDelta,
    ResultDeltaBatch,
    Shutdown,
    TokenDeltas,
)
from protocol.actor_start import from_plain, read_start
from protocol.client_link import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS
from protocol.process_runtime import (
    POLL_MS,
    ProcessRuntime,
    Started,
    actor_process,
    start_and_serve,
)
from protocol.sockets import RouterSocket
from protocol.startup_phases import PhaseClock

log = logging.getLogger("nanopipe.detokenizer")

STOP, ABORT = FinishReason.STOP, FinishReason.ABORT


@dataclass(frozen=True)
class DetokenizerConfig:
    model: str
    """Model directory (its tokenizer decodes the tokens)."""
    max_model_len: int
    """Echoed in the results socket's ClientWelcome: the same limit as the tokenizer's."""
    model_name: str | None = None

    @property
    def served_name(self) -> str:
        return self.model_name or Path(self.model).name


@dataclass(slots=True)
class _Request:
    info: DetokRequestInfo
    detok: IncrementalDetokenizer
    completion_tokens: int = 0
    # Accumulated only when not streaming: the single final delta carries everything.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top: Top | None = None


class DetokenizerActor:
    def __init__(self, config: DetokenizerConfig, endpoints: Endpoints, rt: ProcessRuntime,
                 decode: DecodeFn, token_bytes: TokenBytes | None = None) -> None:
        self.config = config
        self.endpoints = endpoints
        self.rt = rt
        self.decode = decode
        self.token_bytes = token_bytes  # spells the tokens of logprobs
        self.inbox = rt.socket(zmq.PULL, endpoints.detok_in, bind=True,
                               accepts=(DetokRequestInfo, TokenDeltas, EngineDead, Shutdown),
                               security=endpoints.keys)
        # Heartbeats drop the route of a client whose host vanished, so its streaming
        # requests are aborted at their next delta instead of running to max_tokens.
        heartbeat = {zmq.HEARTBEAT_IVL: HEARTBEAT_IVL_MS,
                     zmq.HEARTBEAT_TIMEOUT: HEARTBEAT_TIMEOUT_MS}
        self.router = rt.adopt(RouterSocket(rt.ctx, endpoints.results, accepts=(ClientHello,),
                                            options=heartbeat))
        self.to_scheduler = rt.socket(zmq.PUSH, endpoints.scheduler_in, bind=False,
                                      security=endpoints.keys)
        self.peers: dict[str, bytes] = {}  # client_id -> routing id on the results socket
        self.requests: dict[int, _Request] = {}
        self.early: dict[int, list[tuple]] = {}  # deltas that overtook their DetokRequestInfo
        self.handoff_order = HandoffOrder()  # a decode replica's rows that overtook a prefill's
        self.max_announced = -1  # request ids are a counter: at or below this, a missing
        # request has finished (late deltas are dropped), above it it is still to come
        self.dead_reason: str | None = None
        # Final deltas of requests ended by a stop string, until the scheduler's finish
        # brings their metrics: request id -> (route, delta).
        self.held: dict[int, tuple[DetokRequestInfo, ResultDelta]] = {}
        # While one TokenDeltas is handled, results are gathered per client and sent as one
        # frame each: peer -> [(request id, delta)].
        self._batch: dict[bytes, list[tuple[int, ResultDelta]]] | None = None

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox.socket, zmq.POLLIN)
        poller.register(self.router.socket, zmq.POLLIN)
        while self.rt.stop_reason is None:
            ready = dict(poller.poll(POLL_MS))
            if self.router.socket in ready:
                while self.router.poll(0):
                    self._on_client_frame()
            if self.inbox.socket in ready:
                for _ in range(256):
                    if not self.inbox.poll(0):
                        break
                    if not self._on_inbox():
                        return

    def _on_client_frame(self) -> None:
        try:
            peer, hello = self.router.recv_from()
        except ProtocolError as exc:
            peer = getattr(exc, "peer", None)
            if peer is not None:
                self.router.send_to(peer, error_delta("", malformed(exc)))
            return
        if self.dead_reason is not None:
            self.router.send_to(peer, EngineDead(self.dead_reason))
            return
        self.peers[hello.client_id] = peer
        self.router.send_to(peer, ClientWelcome(
            results_address=self.endpoints.results, model=self.config.served_name,
            max_model_len=self.config.max_model_len))

    def _on_inbox(self) -> bool:
        try:
            msg = self.inbox.recv()
        except ProtocolError as exc:
            log.warning("detokenizer: dropped a bad frame: %s", exc)
            return True
        if isinstance(msg, TokenDeltas):
            self._on_deltas(msg)
        elif isinstance(msg, DetokRequestInfo):
            self._on_info(msg)
        elif isinstance(msg, EngineDead):
            self._on_engine_dead(msg.reason)
        else:
            return False
        return True

    def _on_info(self, info: DetokRequestInfo) -> None:
        self.max_announced = max(self.max_announced, info.request_id)
        if self.dead_reason is not None:
            self._send(info, error_delta(info.client_request_id,
                                         engine_dead_error(self.dead_reason)))
            return
        detok = IncrementalDetokenizer(
            self.decode, info.prompt_tail_token_ids,
            skip_special_tokens=info.skip_special_tokens, stop=info.stop,
            include_stop=info.include_stop)
        self.requests[info.request_id] = _Request(info=info, detok=detok)
        for args in self.early.pop(info.request_id, ()):
            self._on_delta(*args)

    def _on_deltas(self, msg: TokenDeltas) -> None:
        logprobs, top_ids, top_lps = msg.logprobs, msg.top_token_ids, msg.top_logprobs
        if not msg.columns_agree():
            log.error("detokenizer: dropped TokenDeltas %d: uneven columns", msg.step_id)
            return
        metrics = dict(zip(msg.metrics_ids, msg.metrics)) if msg.metrics_ids else {}
        (order := self.handoff_order).continued(msg.continued_ids)
        handoffs = set(msg.handoff_ids)
        ordered = bool(order) or bool(handoffs)  # rows to order here: none unless disaggregated
        self._batch = {}
        try:
            for i, request_id in enumerate(msg.request_ids):
                top = Top(top_ids[i], top_lps[i]) if top_ids is not None and top_ids[i] else None
                row = (request_id, msg.token_ids[i], msg.finish_reasons[i], msg.errors[i],
                       logprobs[i] if logprobs is not None else None, top,
                       metrics.get(request_id))
                rows = order.rows(row, request_id in handoffs) if ordered else (row,)
                for args in rows:
                    self._on_delta(*args)
        finally:
            batch, self._batch = self._batch, None
            self._flush(batch)

    def _flush(self, batch: dict[bytes, list[tuple[int, ResultDelta]]]) -> None:
        for peer, items in batch.items():
            msg = items[0][1] if len(items) == 1 else ResultDeltaBatch([d for _, d in items])
            if self.router.send_to(peer, msg):
                continue
            # The client is gone: free its running requests' KV blocks now, not at max_tokens.
            gone = [rid for rid, d in items if d.finish_reason is None and rid in self.requests]
            for rid in gone:
                del self.requests[rid]
            if gone:
                self.to_scheduler.send(AbortRequests(request_ids=gone, reason=ABORT))

    def _on_delta(self, request_id: int, token_ids: list[int], finish: FinishReason | None,
                  error: RequestError | None, logprobs: list[float] | None,
                  top: Top | None = None, metrics: RequestMetrics | None = None) -> None:
        req = self.requests.get(request_id)
        if req is None:
            if request_id > self.max_announced:
                self.early.setdefault(request_id, []).append(
                    (request_id, token_ids, finish, error, logprobs, top, metrics))
            elif finish is not None and request_id in self.held:
                info, delta = self.held.pop(request_id)
                self._send(info, dataclasses.replace(delta, metrics=ended_at_stop(metrics)))
            return
        info = req.info
        if error is not None:
            del self.requests[request_id]
            self._send(info, error_delta(info.client_request_id, error))
            return
        req.completion_tokens += len(token_ids)
        top = top.cut(info.top_logprobs) if top is not None and info.logprobs else None
        if not info.stream and not info.stop:
            self._accumulate(req, request_id, token_ids, finish, logprobs, top, metrics)
            return
        text = req.detok.add(text_token_ids(token_ids, finish))
        stopped_here = False
        if req.detok.finished:
            if finish is None:  # a stop string: the scheduler cannot know, tell it
                self.to_scheduler.send(AbortRequests(request_ids=[request_id], reason=STOP))
                stopped_here = True
            finish, metrics = STOP, ended_at_stop(metrics)
        if finish is not None:
            text += req.detok.flush()
            del self.requests[request_id]
        if not info.logprobs:
            logprobs = None
        if not info.stream:
            req.token_ids.extend(token_ids)
            if logprobs is not None:
                req.logprobs = (req.logprobs or []) + logprobs
            req.top = joined(req.top, top)
            if finish is None:
                return
            text, token_ids, logprobs, top = (req.detok.text, req.token_ids, req.logprobs,
                                              req.top)
        delta = ResultDelta(
            client_request_id=info.client_request_id, text=text, token_ids=token_ids,
            finish_reason=finish, prompt_tokens=info.num_prompt_tokens,
            completion_tokens=req.completion_tokens, logprobs=logprobs, error=None,
            top_token_ids=top.token_ids if top else None,
            top_logprobs=top.logprobs if top else None, metrics=metrics)
        if stopped_here:
            self.held[request_id] = (info, delta)
            return
        if not self._send(info, delta) and finish is None:
            # The client is gone: free the request's KV blocks now, not at max_tokens.
            del self.requests[request_id]
            self.to_scheduler.send(AbortRequests(request_ids=[request_id], reason=ABORT))

    def _accumulate(self, req: _Request, request_id: int, token_ids: list[int],
                    finish: FinishReason | None, logprobs: list[float] | None,
                    top: Top | None, metrics: RequestMetrics | None) -> None:
        """A non-streaming request with no stop strings needs no text until it ends: decode
        once then, instead of once per step."""
        req.token_ids.extend(token_ids)
        if req.info.logprobs and logprobs is not None:
            req.logprobs = (req.logprobs or []) + logprobs
        req.top = joined(req.top, top)
        if finish is None:
            return
        del self.requests[request_id]
        ids = req.token_ids
        text = req.detok.add(text_token_ids(ids, finish)) + req.detok.flush()
        self._send(req.info, ResultDelta(
            client_request_id=req.info.client_request_id, text=text, token_ids=ids,
            finish_reason=finish, prompt_tokens=req.info.num_prompt_tokens,
            completion_tokens=req.completion_tokens, logprobs=req.logprobs, error=None,
            top_token_ids=req.top.token_ids if req.top else None,
            top_logprobs=req.top.logprobs if req.top else None, metrics=metrics))

    def _send(self, info: DetokRequestInfo, delta: Any) -> bool:
        peer = self.peers.get(info.client_id)
        if peer is None:
            return False
        if isinstance(delta, ResultDelta) and self.token_bytes is not None:
            delta = self.token_bytes.spelled(delta)
        if self._batch is not None and isinstance(delta, ResultDelta):
            self._batch.setdefault(peer, []).append((info.request_id, delta))
            return True
        return self.router.send_to(peer, delta)

    def _on_engine_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        # EngineDead before the error deltas: a client then fails its requests with
        # EngineDeadError rather than taking the error deltas below for rejections.
        for info, delta in self.held.values():  # complete: they only lack their metrics
            self._send(info, delta)
        self.held.clear()
        for peer in self.peers.values():
            self.router.send_to(peer, EngineDead(reason))
        for req in self.requests.values():
            self._send(req.info, error_delta(req.info.client_request_id,
                                             engine_dead_error(reason)))
        self.requests.clear()
        self.early.clear()


def run_detokenizer(config: DetokenizerConfig, endpoints: Endpoints) -> None:
    """Process entry point: serve until Shutdown, SIGTERM/SIGINT or the parent's death."""
    with actor_process("detokenizer", endpoints) as rt:
        def start() -> Started:
            clock = PhaseClock()
            tokenizer = load_decoder(config.model)  # from the cache, without transformers
            clock.mark("tokenizer")
            actor = DetokenizerActor(config, endpoints, rt, make_decode_fn(tokenizer),
                                     TokenBytes(tokenizer))
            return Started(actor.serve, f"model={config.served_name}", phases=clock.phases)

        start_and_serve(rt, endpoints, start)


def main() -> None:
    """`python -m frontend.actors.detokenizer`, started by the launcher (spec on stdin)."""
    start = read_start()
    run_detokenizer(from_plain(DetokenizerConfig, start.config["detokenizer"]),
                    from_plain(Endpoints, start.config["endpoints"]))


if __name__ == "__main__":
    main()

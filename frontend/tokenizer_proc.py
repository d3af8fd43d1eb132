"""The tokenizer actor: the pipeline's front door.

It greets clients, validates and tokenizes their requests, assigns request ids, and tells
the detokenizer about a request before the scheduler hears of it (so results always find
their route). Bad input is answered on the spot and never reaches the rest of the pipeline.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from frontend.incremental_detok import PROMPT_TAIL_TOKENS
from frontend.request_validation import InvalidRequest, RequestValidator, salvage_request_id
from protocol import (
    AbortRequest,
    AbortRequests,
    AddRequest,
    ClientHello,
    ClientWelcome,
    DetokRequestInfo,
    Endpoints,
    EngineDead,
    GenerateRequest,
    ProtocolError,
    ResultDelta,
    Shutdown,
)
from protocol.process_runtime import POLL_MS, ProcessRuntime
from protocol.sockets import RouterSocket

log = logging.getLogger(__name__)

MAX_TRACKED_REQUESTS = 1 << 18
"""Request ids remembered for aborts. The tokenizer never learns when a request ends, so
the oldest are forgotten first; aborting a long-finished request is a no-op anyway."""


@dataclass(frozen=True)
class TokenizerConfig:
    model: str
    """Model directory (holds the tokenizer files and config.json)."""
    max_model_len: int
    model_name: str | None = None
    """Name reported to clients; defaults to the directory name."""
    vocab_size: int | None = None
    """Valid token ids are [0, vocab_size); None reads it from config.json / the tokenizer."""

    @property
    def served_name(self) -> str:
        return self.model_name or Path(self.model).name


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def eos_token_ids(model: str, tokenizer: Any) -> list[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer, merged."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else (value or []))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def model_vocab_size(model: str, tokenizer: Any) -> int:
    path = Path(model) / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
        if isinstance(size, int) and size > 0:
            return size
    return len(tokenizer)


def error_delta(client_request_id: str, error: str) -> ResultDelta:
    return ResultDelta(client_request_id=client_request_id, text="", token_ids=[],
                       finish_reason="error", prompt_tokens=0, completion_tokens=0,
                       logprobs=None, error=error)


class TokenizerActor:
    def __init__(self, config: TokenizerConfig, endpoints: Endpoints, rt: ProcessRuntime,
                 tokenizer: Any) -> None:
        self.config = config
        self.endpoints = endpoints
        self.rt = rt
        vocab = config.vocab_size or model_vocab_size(config.model, tokenizer)
        self.validator = RequestValidator(tokenizer, vocab, config.max_model_len)
        self.eos_ids = eos_token_ids(config.model, tokenizer)
        self.router = rt.adopt(RouterSocket(
            rt.ctx, endpoints.tokenizer, accepts=(ClientHello, GenerateRequest, AbortRequest)))
        self.ctl = rt.socket(zmq.PULL, endpoints.tokenizer_ctl, bind=True,
                             accepts=(EngineDead, Shutdown), security=endpoints.keys)
        self.to_scheduler = rt.socket(zmq.PUSH, endpoints.scheduler_in, bind=False,
                                      security=endpoints.keys)
        self.to_detok = rt.socket(zmq.PUSH, endpoints.detok_in, bind=False,
                                  security=endpoints.keys)
        self.clients: dict[bytes, str] = {}  # peer routing id -> client_id
        self.request_ids: OrderedDict[tuple[bytes, str], int] = OrderedDict()
        self.next_request_id = 0
        self.dead_reason: str | None = None

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router.socket, zmq.POLLIN)
        poller.register(self.ctl.socket, zmq.POLLIN)
        while self.rt.stop_reason is None:
            ready = dict(poller.poll(POLL_MS))
            if self.ctl.socket in ready and not self._on_control():
                return
            if self.router.socket in ready:
                # Drain a bounded batch so control messages are never starved.
                for _ in range(256):
                    if not self.router.poll(0):
                        break
                    self._on_client_frame()

    def _on_control(self) -> bool:
        try:
            msg = self.ctl.recv()
        except ProtocolError as exc:
            log.warning("tokenizer: bad control frame: %s", exc)
            return True
        if isinstance(msg, Shutdown):
            return False
        self.dead_reason = msg.reason
        for peer in list(self.clients):
            self.router.send_to(peer, EngineDead(msg.reason))
        return True

    def _on_client_frame(self) -> None:
        frames = self.router.socket.recv_multipart(copy=False)
        peer = frames[0].bytes
        if len(frames) != 2:
            self.router.send_to(peer, error_delta("", "malformed message: expected one frame"))
            return
        try:
            msg = self.router.decode(frames[1].buffer)
        except ProtocolError as exc:
            request_id = salvage_request_id(frames[1].buffer) or ""
            self.router.send_to(peer, error_delta(request_id, f"malformed message: {exc}"))
            return
        if isinstance(msg, ClientHello):
            self._on_hello(peer, msg)
        elif isinstance(msg, GenerateRequest):
            self._on_generate(peer, msg)
        else:
            self._on_abort(peer, msg)

    def _on_hello(self, peer: bytes, msg: ClientHello) -> None:
        if self.dead_reason is not None:
            self.router.send_to(peer, EngineDead(self.dead_reason))
            return
        self.clients[peer] = msg.client_id
        self.router.send_to(peer, ClientWelcome(
            results_address=self.endpoints.results, model=self.config.served_name,
            max_model_len=self.config.max_model_len))

    def _on_generate(self, peer: bytes, req: GenerateRequest) -> None:
        if self.dead_reason is not None:
            self.router.send_to(peer, EngineDead(self.dead_reason))
            return
        client_id = self.clients.get(peer)
        if client_id is None:
            self.router.send_to(peer, error_delta(
                req.client_request_id, "send ClientHello before any request"))
            return
        try:
            ids = self.validator.prompt_token_ids(req)
        except InvalidRequest as exc:
            self.router.send_to(peer, error_delta(req.client_request_id, str(exc)))
            return
        except Exception as exc:  # a tokenizer failure is this request's problem only
            log.exception("tokenizer: could not tokenize request")
            self.router.send_to(peer, error_delta(
                req.client_request_id, f"the prompt could not be tokenized: {exc}"))
            return
        request_id = self.next_request_id
        self.next_request_id += 1
        params = req.params
        if params.max_tokens is None:
            params = dataclasses.replace(
                params, max_tokens=self.validator.max_tokens(len(ids), None))
        # The detokenizer must know the route before any token of this request can exist.
        self.to_detok.send(DetokRequestInfo(
            request_id=request_id, client_id=client_id,
            client_request_id=req.client_request_id,
            prompt_tail_token_ids=ids[-PROMPT_TAIL_TOKENS:], num_prompt_tokens=len(ids),
            stop=list(params.stop), skip_special_tokens=params.skip_special_tokens,
            stream=req.stream, logprobs=params.logprobs, top_logprobs=params.top_logprobs))
        self.to_scheduler.send(AddRequest(request_id=request_id, prompt_token_ids=ids,
                                          params=params, eos_token_ids=self.eos_ids))
        key = (peer, req.client_request_id)
        self.request_ids[key] = request_id
        self.request_ids.move_to_end(key)
        if len(self.request_ids) > MAX_TRACKED_REQUESTS:
            self.request_ids.popitem(last=False)

    def _on_abort(self, peer: bytes, msg: AbortRequest) -> None:
        request_id = self.request_ids.pop((peer, msg.client_request_id), None)
        if request_id is not None:
            self.to_scheduler.send(AbortRequests(request_ids=[request_id], reason="abort"))


def run_tokenizer(config: TokenizerConfig, endpoints: Endpoints) -> None:
    """Process entry point: serve until Shutdown, SIGTERM/SIGINT or the parent's death."""
    rt = ProcessRuntime("tokenizer")
    try:
        try:
            actor = TokenizerActor(config, endpoints, rt, load_tokenizer(config.model))
            info = f"model={config.served_name} vocab_size={actor.validator.vocab_size}"
            rt.report_ready(endpoints.control, info, security=endpoints.keys)
        except Exception as exc:
            log.exception("tokenizer: start-up failed")
            rt.report_failure(endpoints.control, exc, security=endpoints.keys)
            raise SystemExit(1) from exc
        actor.serve()
    finally:
        rt.close()

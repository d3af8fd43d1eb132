"""Fixtures for the frontend tests: a sentencepiece-style tokenizer, and the real tokenizer
and detokenizer processes wired to a stand-in scheduler (`FakeScheduler`).

The stand-in only echoes prompt tokens back as "generated" tokens, so the frontend's
decoding, routing and error paths can be tested without a model; the whole pipeline is
tested elsewhere.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import zmq

from frontend.actors.detokenizer import DetokenizerConfig, run_detokenizer
from frontend.actors.tokenizer import TokenizerConfig, run_tokenizer
from protocol import (
    AbortRequests,
    AddRequest,
    Endpoints,
    EngineDead,
    ErrorKind,
    FinishReason,
    Ready,
    RequestError,
    StartupFailed,
    TokenDeltas,
    encode,
)
from protocol.sockets import MessageSocket

MAX_MODEL_LEN = 128
FAIL_SEED = 666
"""A request with this seed fails in the stand-in scheduler (an error in TokenDeltas)."""
DEAD_SEED = 667
"""A request with this seed fails as the real scheduler fails requests once the engine died."""


@dataclass
class _Running:
    request: AddRequest
    produced: int = 0


@dataclass
class FakeScheduler:
    """STAND-IN for the scheduler process, running as a thread of the test.

    Binds scheduler_in, pushes to detok_in. Each step "generates" the next prompt token
    for every running request (cycling through the prompt), so the output text of a
    request echoes its prompt. Ends a request with LENGTH after max_tokens (None: the rest of
    max_model_len), with STOP on an EOS/stop token id, with ABORT on AbortRequests; fails
    seed FAIL_SEED. Unlike the real one, it judges no request's length.
    """

    endpoints: Endpoints
    step_s: float = 0.001
    paused: bool = False
    """While set, no tokens are produced (messages are still taken in)."""
    added: list[AddRequest] = field(default_factory=list)
    aborts: list[AbortRequests] = field(default_factory=list)
    engine_dead: list[str] = field(default_factory=list)
    max_model_len: int = MAX_MODEL_LEN

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._inbox = MessageSocket(self._ctx, zmq.PULL, self.endpoints.scheduler_in,
                                    bind=True, accepts=(AddRequest, AbortRequests, EngineDead))
        self._out = MessageSocket(self._ctx, zmq.PUSH, self.endpoints.detok_in, bind=False)
        self._running: dict[int, _Running] = {}
        self._step_id = 0
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self._inbox.poll(int(self.step_s * 1000) or 1):
                    while self._inbox.poll(0):
                        self._on_message(self._inbox.recv())
                if not self.paused:
                    self._step()
        finally:
            self._inbox.close()
            self._out.close()
            self._ctx.term()

    def _on_message(self, msg) -> None:
        if isinstance(msg, AddRequest):
            self.added.append(msg)
            self._running[msg.request_id] = _Running(msg)
        elif isinstance(msg, AbortRequests):
            self.aborts.append(msg)
            ids = [i for i in msg.request_ids if self._running.pop(i, None) is not None]
            if ids:
                self._emit(ids, [[] for _ in ids], [msg.reason] * len(ids), [None] * len(ids),
                           None)
        else:
            self.engine_dead.append(msg.reason)

    def _step(self) -> None:
        ids, tokens, finishes, errors, logprobs = [], [], [], [], []
        for rid, run in list(self._running.items()):
            req = run.request
            prompt = req.prompt_token_ids
            token = prompt[run.produced % len(prompt)]
            run.produced += 1
            finish = error = None
            stops = set(req.params.stop_token_ids)
            if not req.params.ignore_eos:
                stops |= set(req.eos_token_ids)
            max_tokens = req.params.max_tokens or self.max_model_len - len(prompt)
            if req.params.seed == FAIL_SEED:
                finish, error = FinishReason.ERROR, RequestError(
                    ErrorKind.REQUEST_FAILED, "stand-in scheduler failure")
            elif req.params.seed == DEAD_SEED:
                finish, error = FinishReason.ERROR, RequestError(
                    ErrorKind.ENGINE_DEAD, "engine dead: worker 0 exited with code -9")
            elif token in stops:
                finish = FinishReason.STOP
            elif run.produced >= max_tokens:
                finish = FinishReason.LENGTH
            if finish is not None:
                del self._running[rid]
            ids.append(rid)
            tokens.append([token])
            finishes.append(finish)
            errors.append(error)
            logprobs.append([-float(run.produced)])
        if ids:
            self._emit(ids, tokens, finishes, errors, logprobs)

    def _emit(self, ids, tokens, finishes, errors, logprobs) -> None:
        self._step_id += 1
        self._out.send(TokenDeltas(step_id=self._step_id, request_ids=ids, token_ids=tokens,
                                   finish_reasons=finishes, errors=errors, logprobs=logprobs))

    def running(self) -> int:
        return len(self._running)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@dataclass
class FrontendPipeline:
    endpoints: Endpoints
    scheduler: FakeScheduler
    processes: dict[str, mp.process.BaseProcess]
    ready: dict[str, Ready]
    links: dict[str, zmq.Socket] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.endpoints.tokenizer

    def send(self, address: str, msg) -> None:
        """Push one message (e.g. EngineDead) to a process's PULL socket, on one link per
        address, as a real sender has: messages to one address arrive in the order sent."""
        sock = self.links.get(address)
        if sock is None:
            sock = self.links[address] = zmq.Context.instance().socket(zmq.PUSH)
            sock.connect(address)
        sock.send(encode(msg))

    def close_links(self) -> None:
        for sock in self.links.values():
            sock.close(linger=0)
        self.links.clear()


def start_frontend(model_dir: str, step_s: float = 0.001,
                   max_model_len: int = MAX_MODEL_LEN) -> FrontendPipeline:
    endpoints = Endpoints.ipc(world_size=1)
    ctx = zmq.Context.instance()
    control = MessageSocket(ctx, zmq.PULL, endpoints.control, bind=True,
                            accepts=(Ready, StartupFailed))
    scheduler = FakeScheduler(endpoints, step_s=step_s, max_model_len=max_model_len)
    spawn = mp.get_context("spawn")
    procs = {
        "tokenizer": spawn.Process(target=run_tokenizer, daemon=True, args=(
            TokenizerConfig(model=model_dir, max_model_len=max_model_len, model_name="tiny"),
            endpoints)),
        "detokenizer": spawn.Process(target=run_detokenizer, daemon=True, args=(
            DetokenizerConfig(model=model_dir, max_model_len=max_model_len,
                              model_name="tiny"), endpoints)),
    }
    pipeline = FrontendPipeline(endpoints, scheduler, procs, {})
    for proc in procs.values():
        proc.start()
    try:
        deadline = time.monotonic() + 60
        while len(pipeline.ready) < 2:
            assert control.poll(int(max(0.0, deadline - time.monotonic()) * 1000)), \
                "frontend processes did not start"
            msg = control.recv()
            assert isinstance(msg, Ready), msg
            pipeline.ready[msg.role] = msg
    except BaseException:
        stop_frontend(pipeline)
        raise
    finally:
        control.close()
    return pipeline


def stop_frontend(pipeline: FrontendPipeline) -> None:
    for proc in pipeline.processes.values():
        if proc.is_alive():
            proc.terminate()
    for proc in pipeline.processes.values():
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    pipeline.scheduler.close()
    pipeline.close_links()  # the processes are gone: nothing left to deliver
    run_dir = pipeline.endpoints.run_dir
    pipeline.endpoints.cleanup()
    assert run_dir is None or not os.path.exists(run_dir)


@pytest.fixture(scope="session")
def pipe(tiny_qwen3_dir):
    pipeline = start_frontend(tiny_qwen3_dir)
    yield pipeline
    stop_frontend(pipeline)
    assert all(p.exitcode == 0 for p in pipeline.processes.values()), \
        {n: p.exitcode for n, p in pipeline.processes.items()}


@pytest.fixture
def fresh_pipe(tiny_qwen3_dir):
    """A pipeline of its own, for tests that break it."""
    pipeline = start_frontend(tiny_qwen3_dir)
    yield pipeline
    stop_frontend(pipeline)


@pytest.fixture(scope="session")
def sp_tokenizer_dir(tmp_path_factory) -> str:
    """A Llama-style sentencepiece tokenizer (Metaspace, byte fallback), built offline."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = Path(__file__).resolve().parents[2] / "scripts" / "make_tiny_model.py"
    text = corpus.read_text()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator([text] * 2, trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte-fallback pieces, as in Llama's tokenizer
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["model"]["unk_token"] = None
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    out = tmp_path_factory.mktemp("sp_tokenizer")
    fast.save_pretrained(out)
    return str(out)

"""No client can stall another: prompts are measured before they are tokenized, and
tokenized off the tokenizer's I/O loop (real tokenizer and detokenizer processes)."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from frontend import Client, RequestRejected
from protocol import (
    MAX_FRAME_BYTES,
    ClientHello,
    ClientWelcome,
    Decoder,
    FinishReason,
    GenerateRequest,
    ResultDelta,
    SamplingParams,
    encode,
)
from tests.frontend.conftest import start_frontend, stop_frontend

BIG_MODEL_LEN = 1 << 21
"""Lets a multi-megabyte prompt fit, so it is tokenized (for seconds) rather than refused."""
BIG = "hello world, the quick brown fox " * 60_000  # ~2 MB, ~700k tokens here
ONE = SamplingParams(max_tokens=1)


@pytest.fixture(scope="module")
def big_pipe(tiny_qwen3_dir):
    pipeline = start_frontend(tiny_qwen3_dir, max_model_len=BIG_MODEL_LEN)
    yield pipeline
    stop_frontend(pipeline)


def test_a_long_prompt_does_not_hold_another_clients_short_one(big_pipe):
    finished: list[str] = []
    with Client(big_pipe.address, timeout=120) as a, Client(big_pipe.address) as b:
        def long_request() -> None:
            out = a.generate(BIG, params=ONE)
            assert out.prompt_tokens > 100_000
            finished.append("long")

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(0.5)  # the long prompt is being tokenized now
        assert b.generate("short", params=ONE).finish_reason == "length"
        finished.append("short")
        thread.join(120)
    assert finished == ["short", "long"]


def test_an_abort_reaches_a_request_still_waiting_to_be_tokenized(big_pipe):
    with Client(big_pipe.address, timeout=120) as a, Client(big_pipe.address) as c:
        # c's long prompt holds the one thread that long prompts may use ...
        blocker = threading.Thread(target=lambda: c.generate(BIG, params=ONE))
        blocker.start()
        time.sleep(0.3)
        # ... so a's waits in the queue, where its abort finds it.
        stream = a.stream(BIG + "x", params=SamplingParams(max_tokens=5))
        time.sleep(0.3)
        a.abort(stream.request_id)
        assert [d.finish_reason for d in stream] == ["abort"]
        blocker.join(120)
    added = [r for r in big_pipe.scheduler.added if len(r.prompt_token_ids) > 100_000]
    assert all(r.params.max_tokens == 1 for r in added)  # a's request never got there


def _peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        kb = next(line for line in f if line.startswith("VmHWM")).split()[1]
    return int(kb) * 1024


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(pipe):
    """max_model_len is 128 here: a 30 MB prompt would take minutes and gigabytes."""
    tokenizer_pid = pipe.processes["tokenizer"].pid
    peak_before = _peak_rss_bytes(tokenizer_pid)
    with Client(pipe.address, timeout=30) as client:
        start = time.monotonic()
        with pytest.raises(RequestRejected, match="shorten the prompt"):
            client.generate("x" * (30 << 20))
        with pytest.raises(RequestRejected, match=r"^prompt is 4000 bytes"):
            client.generate("y" * 4000)
        with pytest.raises(RequestRejected, match=r"^messages is 4000 bytes"):
            client.generate(messages=[{"role": "user", "content": "z" * 2000}] * 2)
        assert time.monotonic() - start < 10
        assert client.generate("fine", params=ONE).finish_reason == "length"
    assert _peak_rss_bytes(tokenizer_pid) - peak_before < 4 * (30 << 20)


def _raw_client(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 20_000)
    sock.connect(address)
    sock.send(encode(ClientHello("raw")))
    assert isinstance(Decoder(ClientWelcome).decode(sock.recv()), ClientWelcome)
    return sock


@pytest.mark.parametrize("size", [2 << 20, MAX_FRAME_BYTES + 1])
def test_an_oversized_frame_is_refused_by_its_request_id(pipe, size):
    sock = _raw_client(pipe.address)
    try:
        sock.send(encode(GenerateRequest("big-1", "x" * size, None, None, ONE, False)))
        reply = Decoder(ResultDelta).decode(sock.recv())
        assert reply.client_request_id == "big-1" and "shorten the prompt" in reply.error.message
    finally:
        sock.close()


def test_a_req_socket_gets_a_reply_it_can_read(pipe):
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(pipe.address)
    try:
        sock.send(encode(ClientHello("req-peer")))
        reply = Decoder(ResultDelta).decode(sock.recv())
        assert reply.finish_reason is FinishReason.ERROR and "zmq.DEALER" in reply.error.message
        sock.send(encode(GenerateRequest("req-1", "hi", None, None, ONE, False)))
        reply = Decoder(ResultDelta).decode(sock.recv())
        assert reply.client_request_id == "req-1" and "zmq.DEALER" in reply.error.message
    finally:
        sock.close()
    with Client(pipe.address, timeout=30) as client:
        assert client.generate("ok", params=ONE).finish_reason == "length"

"""The real tokenizer and detokenizer processes, driven through the real Client.

The scheduler is the in-test stand-in from conftest.py (it echoes prompt tokens).
"""

from __future__ import annotations

import gc
import threading
import time
import uuid

import msgpack
import pytest
import zmq
from transformers import AutoTokenizer

from frontend import Client, ClientClosedError, EngineDeadError, RequestRejected
from protocol import (
    ClientHello,
    ClientWelcome,
    Decoder,
    FinishReason,
    GenerateRequest,
    ResultDelta,
    SamplingParams,
    encode,
)
from tests.frontend.conftest import DEAD_SEED, FAIL_SEED

PROMPT = "The capital of France is Paris."


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    return AutoTokenizer.from_pretrained(tiny_qwen3_dir)


@pytest.fixture(scope="module")
def client(pipe):
    with Client(pipe.address, timeout=30) as c:
        yield c


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text))


def test_handshake(client):
    assert client.model == "tiny" and client.max_model_len == 128


def test_generate_echoes_the_prompt(pipe, client, tokenizer):
    n = n_tokens(tokenizer, PROMPT)
    out = client.generate(PROMPT, params=SamplingParams(max_tokens=n))
    assert out.text == PROMPT
    assert out.token_ids == tokenizer.encode(PROMPT)
    assert (out.finish_reason, out.prompt_tokens, out.completion_tokens) == ("length", n, n)
    assert out.logprobs is None
    added = pipe.scheduler.added[-1]
    assert added.prompt_token_ids.tolist() == tokenizer.encode(PROMPT)
    assert added.eos_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_stream_deltas_add_up_to_generate(client, tokenizer):
    text = "héllo 😀 wörld 日本"
    n = n_tokens(tokenizer, text)
    deltas = list(client.stream(text, params=SamplingParams(max_tokens=n)))
    assert len(deltas) == n
    assert [d.completion_tokens for d in deltas] == list(range(1, n + 1))
    assert all(len(d.token_ids) == 1 for d in deltas)
    assert not any("\ufffd" in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == text
    assert [d.finish_reason for d in deltas] == [None] * (n - 1) + ["length"]
    assert client.generate(text, params=SamplingParams(max_tokens=n)).text == text


def test_token_ids_and_chat_prompts(client, tokenizer):
    ids = tokenizer.encode("Rivers run to the sea")
    out = client.generate(prompt_token_ids=ids, params=SamplingParams(max_tokens=len(ids)))
    assert out.text == "Rivers run to the sea" and out.prompt_tokens == len(ids)
    msgs = [{"role": "user", "content": "hi"}]
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    out = client.generate(messages=msgs, params=SamplingParams(max_tokens=3, ignore_eos=True))
    assert out.prompt_tokens == len(chat_ids) and out.token_ids == chat_ids[:3]


def test_logprobs_pass_through(client):
    out = client.generate(PROMPT, params=SamplingParams(max_tokens=4, logprobs=True))
    assert out.logprobs == [-1.0, -2.0, -3.0, -4.0]
    deltas = list(client.stream(PROMPT, params=SamplingParams(max_tokens=3, logprobs=True)))
    assert [d.logprobs for d in deltas] == [[-1.0], [-2.0], [-3.0]]


def test_stop_string_ends_the_request_and_tells_the_scheduler(pipe, client):
    params = SamplingParams(max_tokens=30, stop=["Paris"])
    out = client.generate(PROMPT, params=params)
    assert out.text == "The capital of France is " and out.finish_reason == "stop"
    rid = pipe.scheduler.added[-1].request_id
    wait_for(lambda: any(a.request_ids == [rid] and a.reason is FinishReason.STOP
                         for a in pipe.scheduler.aborts))
    deltas = list(client.stream(PROMPT, params=params))
    assert "".join(d.text for d in deltas) == "The capital of France is "
    assert deltas[-1].finish_reason == "stop"
    assert not any("Par" in d.text for d in deltas)


def test_eos_stops_without_its_text(client, tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("one two") + [eos, 5]
    for skip in (True, False):
        out = client.generate(prompt_token_ids=ids, params=SamplingParams(
            max_tokens=10, skip_special_tokens=skip))
        assert out.finish_reason == "stop"
        assert out.token_ids == ids[:-1] and out.text == "one two"


def test_special_tokens_skipped_or_kept(client, tokenizer):
    ids = tokenizer.encode("a<|im_start|>b")
    skipped = client.generate(prompt_token_ids=ids, params=SamplingParams(max_tokens=len(ids)))
    kept = client.generate(prompt_token_ids=ids, params=SamplingParams(
        max_tokens=len(ids), skip_special_tokens=False))
    assert (skipped.text, kept.text) == ("ab", "a<|im_start|>b")


def test_rejections_reach_the_client_and_others_go_on(pipe, client):
    long_running = client.stream(PROMPT, params=SamplingParams(max_tokens=100, ignore_eos=True))
    first = next(long_running)
    bad = [  # (request, message, the field the error names)
        (dict(prompt=""), "prompt must not be empty", "prompt"),
        (dict(prompt=None), "exactly one of prompt, prompt_token_ids and messages", "prompt"),
        (dict(prompt="x", prompt_token_ids=[1]), "exactly one of", "prompt"),
        (dict(prompt_token_ids=[1, 99999]), "prompt_token_ids[1] = 99999", "prompt_token_ids"),
        (dict(prompt_token_ids=[-5]), "prompt_token_ids[0] = -5", "prompt_token_ids"),
        (dict(prompt="hi", params=SamplingParams(stop_token_ids=[99999])),
         "params.stop_token_ids[0] = 99999", "params.stop_token_ids"),
        (dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role", "messages"),
        (dict(messages=[]), "messages must not be empty", "messages"),
    ]
    for kwargs, expected, field in bad:
        with pytest.raises(RequestRejected, match=expected.replace("[", r"\[")) as info:
            client.generate(**kwargs)
        assert info.value.field == field
        with pytest.raises(RequestRejected, match=expected.replace("[", r"\[")) as info:
            next(client.stream(**kwargs))
        assert info.value.field == field
    rest = list(long_running)
    assert first.completion_tokens + len(rest) == 100 and rest[-1].finish_reason == "length"
    assert client.generate(PROMPT, params=SamplingParams(max_tokens=2)).finish_reason == "length"


def test_scheduler_error_reaches_the_client(client):
    with pytest.raises(RequestRejected, match="stand-in scheduler failure"):
        client.generate(PROMPT, params=SamplingParams(seed=FAIL_SEED))
    with pytest.raises(EngineDeadError, match="worker 0 exited"):
        client.generate(PROMPT, params=SamplingParams(seed=DEAD_SEED))
    with pytest.raises(EngineDeadError, match="worker 0 exited"):
        list(client.stream(PROMPT, params=SamplingParams(seed=DEAD_SEED)))


def test_many_concurrent_requests_over_one_client(client, tokenizer):
    texts = [f"{i} bread and {i * 7} dogs" for i in range(24)]
    results: dict[int, str] = {}

    def run(i: int) -> None:
        n = n_tokens(tokenizer, texts[i])
        params = SamplingParams(max_tokens=n)
        if i % 2:
            results[i] = "".join(d.text for d in client.stream(texts[i], params=params))
        else:
            results[i] = client.generate(texts[i], params=params).text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == dict(enumerate(texts))


def aborted(pipe, request_id: int) -> bool:
    return any(request_id in a.request_ids and a.reason is FinishReason.ABORT
               for a in pipe.scheduler.aborts)


def test_closing_a_stream_aborts_the_request(pipe, client):
    stream = client.stream(PROMPT, params=SamplingParams(max_tokens=120, ignore_eos=True))
    next(stream), next(stream)
    rid = pipe.scheduler.added[-1].request_id
    stream.close()
    wait_for(lambda: aborted(pipe, rid))
    wait_for(lambda: pipe.scheduler.running() == 0)


def test_abandoning_a_stream_aborts_the_request(pipe, client):
    def consume_two() -> None:
        for i, _ in enumerate(client.stream(PROMPT, params=SamplingParams(
                max_tokens=120, ignore_eos=True))):
            if i == 1:
                break  # the iterator is dropped here

    consume_two()
    gc.collect()
    rid = pipe.scheduler.added[-1].request_id
    wait_for(lambda: aborted(pipe, rid))


def test_explicit_abort_finishes_with_abort(pipe, client):
    pipe.scheduler.paused = True
    try:
        stream = client.stream(PROMPT, params=SamplingParams(max_tokens=100))
        wait_for(lambda: pipe.scheduler.running() == 1)
        client.abort(stream.request_id)
        deltas = list(stream)
    finally:
        pipe.scheduler.paused = False
    assert [d.finish_reason for d in deltas] == ["abort"]


def test_timeout_aborts(pipe):
    pipe.scheduler.paused = True
    try:
        with Client(pipe.address, timeout=0.3) as c:
            with pytest.raises(TimeoutError):
                c.generate(PROMPT, params=SamplingParams(max_tokens=5))
            rid = pipe.scheduler.added[-1].request_id
            wait_for(lambda: aborted(pipe, rid))
    finally:
        pipe.scheduler.paused = False


def test_close_aborts_in_flight_requests(pipe):
    pipe.scheduler.paused = True
    try:
        c = Client(pipe.address)
        stream = c.stream(PROMPT, params=SamplingParams(max_tokens=50))
        wait_for(lambda: pipe.scheduler.running() == 1)
        rid = pipe.scheduler.added[-1].request_id
        c.close()
        wait_for(lambda: aborted(pipe, rid))
        with pytest.raises(ClientClosedError):
            next(stream)
        with pytest.raises(ClientClosedError):
            c.generate("hi")
    finally:
        pipe.scheduler.paused = False


def test_a_dropped_client_closes_itself(pipe):
    """Neither closed nor used as a context manager: collecting it stops its I/O thread,
    releases its pipe and aborts what it left in flight."""
    pipe.scheduler.paused = True
    try:
        client = Client(pipe.address)
        conn = client._conn
        client.generate_in_flight = client.stream(PROMPT, params=SamplingParams(max_tokens=50))
        wait_for(lambda: pipe.scheduler.running() == 1)
        rid = pipe.scheduler.added[-1].request_id
        del client  # the stream and the client refer to each other: only the cycle GC frees them
        gc.collect()
        wait_for(lambda: aborted(pipe, rid))
        conn._thread.join(timeout=10)
        assert not conn._thread.is_alive() and conn.closed and conn._released
    finally:
        pipe.scheduler.paused = False


def raw_dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(address)
    return sock


def test_malformed_frames_get_errors_and_harm_nothing(pipe, client):
    decoder = Decoder(ClientWelcome, ResultDelta)
    sock = raw_dealer(pipe.address)
    try:
        sock.send(encode(ClientHello(uuid.uuid4().hex)))
        assert isinstance(decoder.decode(sock.recv()), ClientWelcome)
        sock.send(b"\xc1 not msgpack")
        reply = decoder.decode(sock.recv())
        assert reply.finish_reason is FinishReason.ERROR
        assert "malformed message" in reply.error.message
        sock.send_multipart([b"two", b"frames"])
        assert "expected one frame" in decoder.decode(sock.recv()).error.message
        sock.send(msgpack.packb([0x7F, 1, 2]))
        assert "not accepted" in decoder.decode(sock.recv()).error.message
        # Sampling parameters no client library would build: refused by its request id.
        req = msgpack.unpackb(encode(GenerateRequest("bad-1", "hi", None, None,
                                                     SamplingParams(), False)))
        req[5][1] = 7.5  # top_p
        sock.send(msgpack.packb(req))
        reply = decoder.decode(sock.recv())
        assert reply.client_request_id == "bad-1" and "top_p" in reply.error.message
        assert reply.error.field == "params.top_p"
    finally:
        sock.close()
    results = raw_dealer(client.welcome.results_address)
    try:
        results.send(b"junk")
        assert "malformed message" in decoder.decode(results.recv()).error.message
    finally:
        results.close()
    assert client.generate(PROMPT, params=SamplingParams(max_tokens=3)).completion_tokens == 3
    assert all(p.is_alive() for p in pipe.processes.values())


def test_request_before_hello_is_refused(pipe):
    sock = raw_dealer(pipe.address)
    try:
        sock.send(encode(GenerateRequest("r", "hi", None, None, SamplingParams(), False)))
        reply = Decoder(ResultDelta).decode(sock.recv())
        assert reply.client_request_id == "r" and "ClientHello" in reply.error.message
    finally:
        sock.close()

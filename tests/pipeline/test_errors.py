"""Bad input gets a clear error and harms nothing else; blocks come back after an abort."""

from __future__ import annotations

import threading

import msgpack
import pytest
import zmq
from pipeline_config import kv_bytes_per_token, tiny_engine

from frontend import Client, RequestRejected
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from frontend.engine.startup import StartupError
from protocol import (
    ClientHello,
    FinishReason,
    GenerateRequest,
    ResultDelta,
    SamplingParams,
    encode,
)
from protocol.codec import Decoder

OK = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt_token_ids": []}, "prompt"),
        ({"prompt_token_ids": [1, -4, 2]}, "token"),
        ({"prompt_token_ids": [1, 10**9]}, "token"),
        ({"prompt": "word " * 400}, "max_model_len"),
        ({"prompt": "hi", "params": SamplingParams(max_tokens=256)}, "max_model_len"),
        ({"messages": []}, "messages"),
    ],
)
def test_rejected_requests_name_the_problem(qwen3_pipeline, kwargs, field):
    with Client(qwen3_pipeline.address) as client:
        healthy = threading.Thread(target=lambda: client.generate("still fine", params=OK))
        healthy.start()
        with pytest.raises(RequestRejected, match=field):
            client.generate(**kwargs)
        healthy.join()
        assert len(client.generate("and after", params=OK).token_ids) == 8


def test_no_max_tokens_generates_until_the_context_is_full(qwen3_pipeline):
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    with Client(qwen3_pipeline.address) as client:
        out = client.generate(prompt_token_ids=list(range(1, 201)), params=params)
    assert out.finish_reason == "length"
    assert out.completion_tokens == len(out.token_ids) == 256 - 200


def _raw_dealer(address: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(address)
    sock.send(encode(ClientHello("raw")))
    sock.recv()  # welcome
    return ctx, sock


def test_malformed_frames_and_bad_params_on_the_wire(qwen3_pipeline):
    """A client that bypasses the library's checks is answered with errors, and nothing breaks."""
    ctx, sock = _raw_dealer(qwen3_pipeline.address)
    try:
        decoder = Decoder(ResultDelta)
        fields = msgpack.unpackb(encode(GenerateRequest("x", "hello", None, None, OK, False)))
        fields[5][0] = -1.0  # SamplingParams.temperature
        for frame in (b"\x93\x01\x02", b"garbage", msgpack.packb(fields)):
            sock.send(frame)
            reply = decoder.decode(sock.recv())
            assert reply.finish_reason is FinishReason.ERROR and reply.error
        assert "temperature" in reply.error.message
        assert reply.error.field == "params.temperature"
    finally:
        sock.close()
        ctx.term()
    with Client(qwen3_pipeline.address) as client:
        assert len(client.generate("works", params=OK).token_ids) == 8


def test_abort_mid_stream_frees_the_kv_blocks(tiny_qwen3_dir):
    """The pool fits one max-length request: a second one only runs if the abort freed it."""
    block = 16
    kv = kv_bytes_per_token(tiny_qwen3_dir) * block * (256 // block + 1)
    cfg = EngineConfig(**tiny_engine(tiny_qwen3_dir, kv_cache_bytes=kv, block_size=block))
    long = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
    with Pipeline(cfg) as pipeline, Client(pipeline.address) as client:
        stream = client.stream("a long story", params=long)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()  # abandoning the stream aborts the request
        out = client.generate("another long story", params=long)
        assert len(out.token_ids) == 240


def test_kv_pool_smaller_than_one_sequence_refuses_to_start(tiny_qwen3_dir):
    kv = kv_bytes_per_token(tiny_qwen3_dir) * 16 * 4
    cfg = EngineConfig(**tiny_engine(tiny_qwen3_dir, kv_cache_bytes=kv, max_model_len=256))
    with pytest.raises(StartupError, match="max_model_len"):
        Pipeline(cfg).start()

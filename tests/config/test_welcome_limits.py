"""Both client-facing sockets of a running pipeline tell a client the same max_model_len:
the detokenizer's config is derived from the engine's like the tokenizer's."""

from __future__ import annotations

import zmq

from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from protocol import ClientHello, ClientWelcome, Decoder, encode


def _welcome(ctx: zmq.Context, address: str) -> ClientWelcome:
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(address)
        sock.send(encode(ClientHello("limits-test")))
        assert sock.poll(30_000), f"no welcome from {address}"
        return Decoder(ClientWelcome).decode(sock.recv())
    finally:
        sock.close(linger=0)


def test_tokenizer_and_detokenizer_welcome_with_the_engines_limit(tiny_qwen3_dir):
    config = EngineConfig(model=tiny_qwen3_dir, device="cpu", dtype="float32",
                          max_model_len=200, max_num_seqs=4, max_num_batched_tokens=256,
                          served_model_name="tiny")
    ctx = zmq.Context()
    try:
        with Pipeline(config) as pipeline:
            from_tokenizer = _welcome(ctx, pipeline.address)
            from_detokenizer = _welcome(ctx, from_tokenizer.results_address)
    finally:
        ctx.term()
    assert from_tokenizer.max_model_len == from_detokenizer.max_model_len == 200
    assert from_tokenizer.model == from_detokenizer.model == "tiny"

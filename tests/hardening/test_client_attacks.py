"""Attacks a user can make on a running pipeline through its public socket, each made as
that user would make it, against every real process on a tiny CPU model. After each, the
engine must still serve another client, with the same greedy output as before."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import zmq

from frontend import AsyncClient, Client, EngineDeadError, RequestRejected
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
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
from tests.pipeline.pipeline_config import tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROBE = "The capital of France is"


@pytest.fixture(scope="module")
def pipeline(tiny_qwen3_dir):
    with Pipeline(EngineConfig(**tiny_engine(tiny_qwen3_dir))) as pipe:
        yield pipe


@pytest.fixture(scope="module")
def baseline(pipeline) -> list[int]:
    with Client(pipeline.address, timeout=60) as client:
        return client.generate(PROBE, params=GREEDY).token_ids


def still_serves(pipeline, baseline: list[int]) -> None:
    with Client(pipeline.address, timeout=60) as client:
        assert client.generate(PROBE, params=GREEDY).token_ids == baseline


def test_a_16_mb_prompt_is_refused_while_another_client_is_served(pipeline, baseline):
    """It once held every other client for 34 s and took the tokenizer to gigabytes."""
    refused: list[BaseException] = []

    def attack() -> None:
        with Client(pipeline.address, timeout=60) as attacker:
            try:
                attacker.generate("word " * (16 << 20 // 5))
            except RequestRejected as exc:
                refused.append(exc)

    thread = threading.Thread(target=attack)
    start = time.monotonic()
    thread.start()
    with Client(pipeline.address, timeout=60) as victim:
        assert victim.generate(PROBE, params=GREEDY).token_ids == baseline
    thread.join(60)
    assert time.monotonic() - start < 30
    assert len(refused) == 1 and "prompt" in str(refused[0])
    still_serves(pipeline, baseline)


def test_a_prompt_over_the_frame_limit_fails_at_once(pipeline, baseline):
    """It once got an error without its request id, and generate() waited forever."""
    huge = "x" * (MAX_FRAME_BYTES + 1)
    with Client(pipeline.address) as client:  # no timeout: a lost error would hang here
        with pytest.raises(RequestRejected, match="prompt"):
            client.generate(huge)

    async def with_async_client() -> None:
        async with AsyncClient(pipeline.address) as client:
            with pytest.raises(RequestRejected, match="prompt"):
                await client.generate(huge)

    asyncio.run(asyncio.wait_for(with_async_client(), 60))
    # A client that skips the library's check still gets its answer, by request id.
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    try:
        sock.connect(pipeline.address)
        sock.send(encode(ClientHello("raw")))
        assert isinstance(Decoder(ClientWelcome).decode(sock.recv()), ClientWelcome)
        sock.send(encode(GenerateRequest("huge-1", huge, None, None, GREEDY, False)))
        reply = Decoder(ResultDelta).decode(sock.recv())
        assert reply.client_request_id == "huge-1" and reply.finish_reason is FinishReason.ERROR
    finally:
        sock.close()
        ctx.term()
    still_serves(pipeline, baseline)


def test_a_wrong_address_fails_at_once(pipeline, baseline, tmp_path):
    """It once waited 60 s before saying that no pipeline answered."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    start = time.monotonic()
    for address in (pipeline.address + "-typo", f"tcp://127.0.0.1:{free_port}"):
        with pytest.raises(EngineDeadError, match="no pipeline at"):
            Client(address)
        with pytest.raises(EngineDeadError, match="no pipeline at"):
            asyncio.run(AsyncClient(address).start())
    assert time.monotonic() - start < 10
    still_serves(pipeline, baseline)


def test_a_req_socket_gets_an_error_it_can_read(pipeline, baseline):
    """A REQ peer's frames start with an empty delimiter; its replies once lacked one."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        sock.connect(pipeline.address)
        sock.send(encode(GenerateRequest("req-1", PROBE, None, None, GREEDY, False)))
        reply = Decoder(ResultDelta).decode(sock.recv())
        assert reply.client_request_id == "req-1" and "zmq.DEALER" in reply.error.message
    finally:
        sock.close()
        ctx.term()
    still_serves(pipeline, baseline)


def test_a_flood_of_requests_does_not_starve_another_client(pipeline, baseline):
    """One client submits many prompts at once (as LLM.generate does): none is refused as
    busy, and another client's request is still answered, and correctly."""
    async def flood() -> list[str | None]:
        async with AsyncClient(pipeline.address, timeout=120) as client:
            outs = await asyncio.gather(*(
                client.generate(f"prompt number {i}", params=SamplingParams(max_tokens=1))
                for i in range(64)))
            return [o.finish_reason for o in outs]

    results: list[list[str | None]] = []
    thread = threading.Thread(target=lambda: results.append(asyncio.run(flood())))
    thread.start()
    time.sleep(0.2)
    still_serves(pipeline, baseline)
    thread.join(120)
    assert results == [["length"] * 64]

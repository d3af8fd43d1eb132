"""A client never hangs on a dead engine: EngineDead messages and vanished processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import threading
import time

import httpx
import pytest

from frontend import AsyncClient, Client, EngineDeadError
from protocol import EngineDead, FinishReason, SamplingParams, Shutdown
from tests.frontend.conftest import start_frontend, stop_frontend

LONG = SamplingParams(max_tokens=120, ignore_eos=True)


def test_engine_dead_fails_in_flight_and_new_requests(fresh_pipe):
    pipe = fresh_pipe
    pipe.scheduler.step_s = 0.02
    client = Client(pipe.address)
    try:
        stream = client.stream("keep going", params=LONG)
        next(stream)
        pipe.send(pipe.endpoints.tokenizer_ctl, EngineDead("worker 0 died"))
        pipe.send(pipe.endpoints.detok_in, EngineDead("worker 0 died"))
        with pytest.raises(EngineDeadError, match="worker 0 died"):
            for _ in stream:
                pass
        assert client.dead
        with pytest.raises(EngineDeadError, match="worker 0 died"):
            client.generate("after death")
    finally:
        client.close()
    with pytest.raises(EngineDeadError, match="worker 0 died"):
        Client(pipe.address, connect_timeout=10)
    assert all(p.is_alive() for p in pipe.processes.values())
    pipe.send(pipe.endpoints.tokenizer_ctl, Shutdown("bye"))
    pipe.send(pipe.endpoints.detok_in, Shutdown("bye"))
    for proc in pipe.processes.values():
        proc.join(timeout=10)
        assert proc.exitcode == 0


def test_the_launchers_http_server_stops_when_its_client_dies(fresh_pipe):
    """A client of the HTTP server dead while the engine lives (engine_alive says so) is no
    state to serve 503s from forever: the server stops and says why, for its launcher."""
    from frontend.openai_server.server import serve

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    result: dict = {}
    thread = threading.Thread(daemon=True, target=lambda: result.update(lost=serve(
        fresh_pipe.address, sock=sock, log_level="warning", engine_alive=lambda: True)))
    thread.start()
    deadline = time.monotonic() + 30
    while True:
        assert thread.is_alive() and time.monotonic() < deadline
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                break
        time.sleep(0.1)
    fresh_pipe.send(fresh_pipe.endpoints.tokenizer_ctl, EngineDead("worker 0 died"))
    fresh_pipe.send(fresh_pipe.endpoints.detok_in, EngineDead("worker 0 died"))
    thread.join(20)
    assert not thread.is_alive() and result == {"lost": "worker 0 died"}


def test_vanished_pipeline_is_noticed(tiny_qwen3_dir):
    pipe = start_frontend(tiny_qwen3_dir, step_s=0.05)
    try:
        client = Client(pipe.address)
        stream = client.stream("keep going", params=LONG)
        next(stream)

        async def async_side() -> None:
            async with AsyncClient(pipe.address) as aclient:
                astream = aclient.stream("keep going", params=LONG)
                await astream.__anext__()
                os.kill(pipe.processes["detokenizer"].pid, signal.SIGKILL)
                with pytest.raises(EngineDeadError, match="lost the connection"):
                    async for _ in astream:
                        pass
                with pytest.raises(EngineDeadError):
                    await aclient.generate("again")

        asyncio.run(asyncio.wait_for(async_side(), 30))
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="lost the connection"):
            for _ in stream:
                pass
        assert time.monotonic() - start < 10
        with pytest.raises(EngineDeadError):
            client.generate("again")
        client.close()
    finally:
        stop_frontend(pipe)


def test_unreachable_address_fails_fast(tmp_path):
    """No connect_timeout given (60 s): a wrong address is still known at once."""
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="no pipeline at .*No such file"):
        Client(f"ipc://{tmp_path}/nothing")
    with pytest.raises(EngineDeadError, match="no pipeline at .*No such file"):
        asyncio.run(AsyncClient(f"ipc://{tmp_path}/nothing").start())
    assert time.monotonic() - start < 2


@pytest.mark.parametrize("address", ["127.0.0.1:27555", "tpc://127.0.0.1:27555", "", None])
def test_something_that_is_no_address_is_a_value_error(address):
    """Not a dead engine: the address itself is wrong, and the message says what one is."""
    with pytest.raises(ValueError, match="is not a pipeline address.*clients connect to"):
        Client(address)
    with pytest.raises(ValueError, match="is not a pipeline address"):
        asyncio.run(AsyncClient(address).start())


def test_sigterm_stops_a_process_that_is_still_starting(tiny_qwen3_dir, tmp_path):
    import multiprocessing as mp

    from frontend.actors.tokenizer import TokenizerConfig, run_tokenizer
    from protocol import Endpoints

    os.makedirs(tmp_path / "run")
    endpoints = Endpoints.ipc(1, run_dir=str(tmp_path / "run"))
    proc = mp.get_context("spawn").Process(target=run_tokenizer, args=(
        TokenizerConfig(model=tiny_qwen3_dir, max_model_len=64), endpoints))
    proc.start()
    try:
        time.sleep(1.0)  # inside start-up: importing transformers, loading the tokenizer
        proc.terminate()
        proc.join(timeout=20)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        endpoints.cleanup()


PARENT = """
import multiprocessing as mp, sys, time
from frontend.actors.tokenizer import TokenizerConfig, run_tokenizer
from protocol import Endpoints
if __name__ == "__main__":
    endpoints = Endpoints.ipc(1, run_dir=sys.argv[2])
    proc = mp.get_context("spawn").Process(target=run_tokenizer, args=(
        TokenizerConfig(model=sys.argv[1], max_model_len=64), endpoints))
    proc.start()
    print(proc.pid, flush=True)
    time.sleep(600)
"""


def test_child_exits_when_its_parent_is_killed(tiny_qwen3_dir, tmp_path):
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, tiny_qwen3_dir, str(run_dir)],
                              stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.5)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while _alive(child):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.1)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
        shutil.rmtree(run_dir, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_deltas_that_overtake_their_request_info_are_buffered(fresh_pipe, tiny_qwen3_dir):
    """TokenDeltas and DetokRequestInfo reach the detokenizer over different pipes."""
    import zmq
    from transformers import AutoTokenizer

    from protocol import (
        ClientHello,
        ClientWelcome,
        Decoder,
        DetokRequestInfo,
        ResultDelta,
        TokenDeltas,
        encode,
    )

    pipe = fresh_pipe
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    ids = tok.encode(" over the lazy dog")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(pipe.endpoints.results)
    decoder = Decoder(ClientWelcome, ResultDelta)
    try:
        sock.send(encode(ClientHello("watcher")))
        assert isinstance(decoder.decode(sock.recv()), ClientWelcome)
        rid = 10**6
        pipe.send(pipe.endpoints.detok_in, TokenDeltas(1, [rid], [ids[:2]], [None], [None],
                                                       None))
        pipe.send(pipe.endpoints.detok_in, TokenDeltas(2, [rid], [ids[2:]], [FinishReason.LENGTH],
                                                       [None],
                                                       None))
        time.sleep(0.2)
        pipe.send(pipe.endpoints.detok_in, DetokRequestInfo(
            request_id=rid, client_id="watcher", client_request_id="early",
            prompt_tail_token_ids=tok.encode("jumps"), num_prompt_tokens=9, stop=[],
            skip_special_tokens=True, stream=False, logprobs=False))
        out = decoder.decode(sock.recv())
        assert (out.client_request_id, out.text, out.token_ids) == ("early",
                                                                    " over the lazy dog", ids)
        assert (out.finish_reason, out.prompt_tokens, out.completion_tokens) == (
            FinishReason.LENGTH, 9, len(ids))
    finally:
        sock.close()

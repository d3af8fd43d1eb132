"""A real pipeline on a tiny CPU model, its client, and a watcher of the engine's deltas."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "http_api"))
from http_serving import running_server  # noqa: E402

from frontend import AsyncClient, Client
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from frontend.openai_server.server import create_app
from protocol import (
    Decoder,
    FinishReason,
    ProtocolError,
    RequestError,
    SamplingParams,
    TokenDeltas,
)

ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=16,
              max_num_batched_tokens=512)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = "The engine still answers"


@pytest.fixture(scope="module")
def pipeline(tiny_qwen3_dir):
    with Pipeline(EngineConfig(model=tiny_qwen3_dir, **ENGINE)) as pipeline:
        yield pipeline


@pytest.fixture(scope="module")
def client(pipeline):
    with Client(pipeline.address, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def reference(client) -> list[int]:
    """The greedy tokens of PROMPT before any attack: later answers must equal them."""
    return client.generate(PROMPT, params=GREEDY).token_ids


MAX_REQUEST_BYTES = 200_000


@pytest.fixture(scope="module")
def base_url(pipeline):
    """The HTTP server over the pipeline, with a small body cap (413 tests)."""

    @contextlib.asynccontextmanager
    async def make_app():
        async with AsyncClient(pipeline.address) as client:
            yield create_app(client, client.welcome.model, max_request_bytes=MAX_REQUEST_BYTES)

    with running_server(make_app) as url:
        yield url


class DeltaWatcher:
    """Collects every TokenDeltas the scheduler publishes: per request, tokens and outcome."""

    def __init__(self, address: str) -> None:
        self.finished: dict[int, tuple[str, str | None]] = {}
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(address)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(0.3)  # a SUB socket misses what is published before it joins

    def _run(self) -> None:
        decoder = Decoder(TokenDeltas)
        while not self._stop.is_set():
            if not self._sub.poll(50):
                continue
            try:
                msg = decoder.decode(self._sub.recv())
            except ProtocolError:
                continue  # the publisher's heartbeats and request announcements
            for rid, fin, err in zip(msg.request_ids, msg.finish_reasons, msg.errors,
                                     strict=True):
                if fin is not None:
                    self.finished[rid] = (fin, err)

    def wait_for(self, rid: int, timeout: float = 30.0
                 ) -> tuple[FinishReason, RequestError | None]:
        deadline = time.monotonic() + timeout
        while rid not in self.finished:
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {rid} never finished")
            time.sleep(0.02)
        return self.finished[rid]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sub.close(0)
        self._ctx.term()

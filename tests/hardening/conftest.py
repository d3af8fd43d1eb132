"""A real pipeline on a tiny CPU model, its client, and an HTTP server over it."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "http_api"))
from attack_support import ENGINE, GREEDY, MAX_REQUEST_BYTES, PROMPT  # noqa: E402
from http_serving import running_server  # noqa: E402

from frontend import AsyncClient, Client
from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline
from frontend.openai_server.app import create_app


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


@pytest.fixture(scope="module")
def base_url(pipeline):
    """The HTTP server over the pipeline, with a small body cap (413 tests)."""

    @contextlib.asynccontextmanager
    async def make_app():
        async with AsyncClient(pipeline.address) as client:
            yield create_app(client, client.welcome.model, max_request_bytes=MAX_REQUEST_BYTES)

    with running_server(make_app) as url:
        yield url

"""Fixtures that start real pipelines (every process, real sockets) on tiny CPU models."""

from __future__ import annotations

import pytest
from pipeline_config import tiny_engine

from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline


@pytest.fixture(scope="module")
def qwen3_pipeline(tiny_qwen3_dir):
    with Pipeline(EngineConfig(**tiny_engine(tiny_qwen3_dir))) as pipeline:
        yield pipeline

"""Shared pytest fixtures: tiny random models and the skip rule for GPU-only tests.

This file's folder, tests/, is on sys.path for every test, so the helpers beside it
(hf_reference, random_prompts, tiny_models) import by their plain names.
"""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    return str(make_tiny_model("qwen3", tmp_path_factory.mktemp("tiny_qwen3"), seed=0))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama"), seed=0))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

"""Shared pytest fixtures: tiny random models and the skip rule for GPU-only tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]


def _load_make_tiny_model():
    spec = importlib.util.spec_from_file_location(
        "make_tiny_model", _ROOT / "scripts" / "make_tiny_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_tiny_model


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    return str(_load_make_tiny_model()("qwen3", tmp_path_factory.mktemp("tiny_qwen3"), seed=0))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return str(_load_make_tiny_model()("llama", tmp_path_factory.mktemp("tiny_llama"), seed=0))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

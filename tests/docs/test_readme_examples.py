"""The README's Python examples run as a user runs them: each block as its own `python -c`
program (no `__main__` guard), on a tiny model, with only its placeholders filled in."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from frontend.engine.config import EngineConfig
from frontend.engine.pipeline import Pipeline

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(device="cpu", dtype="float32", max_model_len=256)


def _python_block(containing: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    found = [b for b in blocks if containing in b]
    assert len(found) == 1, f"README has {len(found)} python blocks with {containing!r}"
    return found[0]


def _fill(code: str, placeholder: str, value: str) -> str:
    assert placeholder in code, f"the README example no longer has {placeholder!r}"
    return code.replace(placeholder, value)


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"the README example failed:\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
def test_the_llm_example_runs(tiny_qwen3_dir):
    code = _fill(_python_block("LLM("), 'LLM("path/to/model", tensor_parallel_size=1)',
                 f"LLM({tiny_qwen3_dir!r}, tensor_parallel_size=1, **{TINY!r})")
    code += "\nassert len(results) == 2 and len(replies) == 1\n"
    code += "assert results[0]['metrics'] and len(results[0]['token_ids']) >= 1\n"
    out = _run(code)
    assert out.strip(), "the example printed nothing"


@pytest.mark.slow
def test_the_client_example_runs(tiny_qwen3_dir):
    with Pipeline(EngineConfig(model=tiny_qwen3_dir, **TINY)) as pipeline:
        code = _fill(_python_block("Client("), "ipc:///tmp/nanopipe-…/tokenizer",
                     pipeline.address)
        code = code.replace("SamplingParams(temperature=0)",
                            "SamplingParams(temperature=0, max_tokens=8)")
        code += "\nassert out.finish_reason and out.metrics is not None\n"
        _run(code)

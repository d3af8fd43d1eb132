"""An `LLM` wherever users build and call it: in a worker thread (a pool, a web app's start-up
hook) that ends before the LLM is used, and inside a running event loop (a notebook cell).
Each is a plain script that ends without close() and must leave nothing behind."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_plain_scripts import _assert_nothing_left, _engine_info

pytestmark = pytest.mark.slow  # starts engines from threads and interpreters

GREEDY = "SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)"
REPORT = """
print("ENGINE", json.dumps({{"pids": [c.pid for c in llm.pipeline.children],
                             "run_dir": llm.pipeline.endpoints.run_dir,
                             "tokens": out[0]["token_ids"]}}), flush=True)
"""

BUILT_IN_A_POOL = """\
import json, threading, time
from concurrent.futures import ThreadPoolExecutor
from frontend import LLM, SamplingParams

with ThreadPoolExecutor(1) as pool:
    llm = pool.submit(LLM, {model!r}, device="cpu", dtype="float32", max_model_len=128).result()
time.sleep(1.5)  # the pool's thread has ended; the engine must not have
assert llm.pipeline.dead_reason is None, llm.pipeline.dead_reason
out = llm.generate(["Hello"], {params}, use_tqdm=False)
""" + REPORT

CALLED_IN_A_LOOP = """\
import asyncio, json
from frontend import LLM, SamplingParams

llm = LLM({model!r}, device="cpu", dtype="float32", max_model_len=128)
plain = llm.generate(["Hello"], {params}, use_tqdm=False)

async def cell():
    return llm.generate(["Hello"], {params}, use_tqdm=False)

out = asyncio.run(cell())
assert out[0]["token_ids"] == plain[0]["token_ids"]
""" + REPORT


def _run_script(source: str, tmp_path) -> dict:
    path = tmp_path / "user_script.py"
    path.write_text(source)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return _engine_info(done.stdout)


def test_an_llm_built_in_a_thread_that_ends_keeps_its_engine(tiny_qwen3_dir, tmp_path):
    info = _run_script(BUILT_IN_A_POOL.format(model=tiny_qwen3_dir, params=GREEDY), tmp_path)
    assert len(info["tokens"]) == 4
    _assert_nothing_left(info)


def test_generate_inside_a_running_event_loop(tiny_qwen3_dir, tmp_path):
    info = _run_script(CALLED_IN_A_LOOP.format(model=tiny_qwen3_dir, params=GREEDY), tmp_path)
    assert len(info["tokens"]) == 4
    _assert_nothing_left(info)

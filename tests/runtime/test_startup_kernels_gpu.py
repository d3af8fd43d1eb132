"""On CUDA: a first start with --precompile-kernels finds its scratch steps' Triton kernels
inside a throwaway capture, compiles them on a pool, and the profiling and warm-up steps then
compile (almost) nothing themselves; the runner generates what a runner without it does.
Each runner starts in its own process, with empty Triton and nanopipe caches, so no kernel
compiled earlier in the test session hides a variant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]

START = """
import json, sys
from pathlib import Path
sys.path.insert(0, "tests/runtime")
from random_prompts import random_prompts
from rt_helpers import BLOCK_SIZE, make_runner
from rt_planner import Planner

cache = Path(sys.argv[3])
runner = make_runner(sys.argv[1], device="cuda", kv_cache_bytes=None,
                     gpu_memory_utilization=0.3, max_num_batched_tokens=2048,
                     enforce_eager=sys.argv[5] == "eager",
                     precompile_kernels=sys.argv[2] == "on")
cubins = sum(1 for _ in cache.rglob("*.cubin"))
planner = Planner(BLOCK_SIZE, runner.num_kv_blocks)
for i, prompt in enumerate(random_prompts(3, [5, 9, 17, 30])):
    planner.add(i, prompt, 8)
markers = list(Path(sys.argv[4]).rglob("kernels/*.jsonl"))
print(json.dumps({"tokens": planner.run(runner), "cubins": cubins,
                  "parts": [p.name for p in runner.startup.parts],
                  "recorded": sum(len(m.read_text().splitlines()) for m in markers)}))
"""


def _start(model: str, precompile: str, tmp: Path, mode: str) -> dict:
    triton_cache, nanopipe_cache = tmp / f"triton-{precompile}", tmp / f"nanopipe-{precompile}"
    env = dict(os.environ, TRITON_CACHE_DIR=str(triton_cache), NANOPIPE_CACHE=str(nanopipe_cache),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                           *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, "-c", START, model, precompile, str(triton_cache),
                          str(nanopipe_cache), mode], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_a_first_start_compiles_its_kernels_on_a_pool_first(tiny_qwen3_dir, tmp_path, mode):
    on = _start(tiny_qwen3_dir, "on", tmp_path, mode)
    off = _start(tiny_qwen3_dir, "off", tmp_path, mode)
    assert on["parts"][:2] == ["kv.precompile", "kv.profile"]
    assert "kv.precompile" not in off["parts"]
    assert on["recorded"] >= 10
    # The pool compiled what the scratch steps and graph captures needed: they added at most
    # a few variants the captures could not reach (those compile when first used, as
    # without the pool).
    assert on["cubins"] - on["recorded"] <= 3, on
    assert on["tokens"] == off["tokens"]

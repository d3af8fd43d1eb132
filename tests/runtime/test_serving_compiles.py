"""A kernel variant Triton meets once the worker serves is logged with its time, without a
GPU: Triton compiles for an sm_90 target on the CPU (as tests/runtime/test_kernel_precompile.py
does), through the same hooks a launch on the GPU goes through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

SERVE_AND_MEET = """
import json, logging
import torch
from triton import knobs
from gpu_workers.kernel_precompile import _use_target
from gpu_workers.serving_compiles import ServingCompiles

_use_target(("cuda", 90, 32))
from kernels.rms_norm import _rms_norm_kernel as kernel

logging.basicConfig(level=logging.WARNING, format="%(message)s")
seen = []
knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)  # someone's own
x = torch.zeros(4, 256, dtype=torch.float16)

def step(block):  # what a step's launch does with a variant it has not met
    kernel.run(x, x, x[0], x, x, 256, 1e-6, 256, 256, 256, 256, HAS_RESIDUAL=True,
               BLOCK=block, num_warps=2, grid=(4,), warmup=True)

step(256)  # start-up's warm-up: not watched yet
watcher = ServingCompiles(rank=0)
watcher.watch()
for block in (256, 512, 512, 1024):
    step(block)
watcher.stop()
print(json.dumps({"count": watcher.count, "seconds": watcher.seconds, "theirs": seen,
                  "restored": knobs.runtime.jit_cache_hook is None}))
"""


@pytest.mark.slow
def test_variants_met_while_serving_are_counted_and_logged(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", SERVE_AND_MEET], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # The variant the warm-up compiled costs nothing; 512 and 1024 are met once each.
    assert got["count"] == 2 and got["seconds"] > 0
    lines = [line for line in out.stderr.splitlines() if "met a new variant" in line]
    assert len(lines) == 2 and all("_rms_norm_kernel" in line for line in lines)
    assert " ms to compile or load it" in lines[0]
    assert "HAS_RESIDUAL=True, BLOCK=512" in lines[0] and "BLOCK=1024" in lines[1]
    assert "multiples of 16: n_cols, stride_x" in lines[0]
    # A hook installed before the watcher is still called, and put back after it.
    assert got["theirs"] == ["_rms_norm_kernel"] * 3 and got["restored"]
